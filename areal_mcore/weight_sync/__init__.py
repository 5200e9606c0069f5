"""Weight sync: actor -> rollout servers (the one package that knows both)."""
