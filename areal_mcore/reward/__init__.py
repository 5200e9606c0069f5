"""Rewards: boba's math-verify check, run in killable, resource-limited worker processes."""
