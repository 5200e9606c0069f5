"""``algo: dapo | gspo | dr_grpo``: a published algorithm's keys in one word.

Each preset sets the keys its paper changes against boba's PPO (docs/algorithm.md, "Presets"),
over the config file's values; ``key=value`` overrides on the command line still win
(``config.load_config``). ``areal-mcore plan`` prints the keys as resolved, and a run's
checkpoints hold them in the resolved config of their manifest.
"""

from __future__ import annotations

from typing import Any

# Group-normalised advantages (mean and std over a prompt's samples, no batch pass): what
# GRPO-style methods use, DAPO and GSPO included.
_GROUP = {"ppo.reward_norm.mean_level": "group", "ppo.reward_norm.std_level": "group", "ppo.adv_norm": None}

PRESETS: dict[str, dict[str, Any]] = {
    # DAPO (arXiv 2503.14476): clip-higher (0.2 / 0.28), the token-level loss, dynamic
    # sampling; no KL. Its soft overlong punishment depends on the length budget
    # (ppo.overlong_penalty: buffer_len, penalty_factor): set it for yours.
    "dapo": {**_GROUP, "ppo.eps_clip": 0.2, "ppo.eps_clip_high": 0.28, "ppo.loss_agg_mode": "token-mean",
             "rollout.dynamic_sampling": True, "ppo.kl_coef": 0.0},
    # GSPO (arXiv 2507.18071): the sequence-level ratio, clipped at 3e-4 / 4e-4, averaged
    # per sequence.
    "gspo": {**_GROUP, "ppo.importance_sampling_level": "sequence", "ppo.eps_clip": 3e-4,
             "ppo.eps_clip_high": 4e-4, "ppo.loss_agg_mode": "seq-mean-token-mean"},
    # Dr. GRPO (arXiv 2503.20783): no length normalisation (sums per sequence over a
    # constant, ppo.loss_norm_tokens: null is rollout.max_new_tokens) and no std
    # normalisation of the advantages.
    "dr_grpo": {"ppo.reward_norm.mean_level": "group", "ppo.reward_norm.std_level": "none", "ppo.adv_norm": None,
                "ppo.loss_agg_mode": "seq-mean-token-sum-norm"},
}


def preset_tree(name: str) -> dict:
    """Preset ``name`` as nested sections, for merging over a config."""
    tree: dict = {}
    for key, value in PRESETS[name].items():
        *sections, leaf = key.split(".")
        node = tree
        for s in sections:
            node = node.setdefault(s, {})
        node[leaf] = value
    return tree


def describe(cfg) -> str | None:
    """``algo=<name>: key=value ...``, the preset's keys as ``cfg`` resolved them (an
    override on the command line shows as its value); None without a preset."""
    name = getattr(cfg, "algo", None)
    if not name:
        return None
    values = []
    for key in PRESETS[name]:
        node = cfg
        for part in key.split("."):
            node = None if node is None else getattr(node, part)
        values.append(f"{key}={'null' if node is None else node}")
    return f"algo={name}: " + " ".join(values)
