"""``areal-mcore eval``: pass@k of a model over n samples per problem, with boba's eval
settings (sampling per model kind, boba prompt suffix, ``<think>`` forcing, long-context
server flags, optional shuffling of multiple-choice options)."""

from areal_mcore.eval.config import EvalConfig
from areal_mcore.eval.passk import pass_at_k, pass_at_ks
from areal_mcore.eval.run import evaluate, format_table

__all__ = ["EvalConfig", "evaluate", "format_table", "pass_at_k", "pass_at_ks"]
