"""A short training run under whichever megatron-core this python has, for comparing versions.

tests/test_mcore_versions.py runs it in each venv (megatron-core 0.16.1 and 0.19.x):

    python tests/_mcore_run.py train  OUT HF_DIR            # steps 0-1, save, step 2
    python tests/_mcore_run.py resume OUT HF_DIR CKPT_ROOT  # resume CKPT_ROOT (step 2), step 2

``train`` saves the step-2 checkpoint under OUT/ckpt, exports it with the HF converter to
OUT/hf, and writes the weights after one more step to OUT/final.safetensors. ``resume``
exports another run's checkpoint (possibly saved by the other megatron-core version) with
this version's converter to OUT/hf, resumes it and writes the weights after the same last
step to OUT/final.safetensors. Both write OUT/result.json (versions, losses), or the
refusal message if the checkpoint was refused.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _actor_setup import LENGTHS, ppo_loss, seqs, train_fields
from safetensors.torch import save_file

from areal_mcore.packing import pack

SAVE_AT, N_STEPS = 2, 3


def _batch(step: int):
    s = seqs(LENGTHS, seed=100 + step)
    return pack(s, train_fields(s, seed=200 + step))


def _actor(hf_dir: Path):
    from areal_mcore.actor.config import (
        ActorConfig,
        MicroBatchSpec,
        OptimizerConfig,
        ParallelConfig,
    )
    from areal_mcore.actor.megatron_actor import MegatronActor
    from areal_mcore.convert.tools import _load_hf_config, load_hf_state_dict

    cfg = ActorConfig(mb_spec=MicroBatchSpec(max_tokens_per_mb=16),
                      optimizer=OptimizerConfig(lr=1e-3, eps=1e-5, weight_decay=0.01),
                      parallel=ParallelConfig(tp=1, pp=1), vocab_divisible_by=8)
    actor = MegatronActor(cfg, _load_hf_config(hf_dir), seed=1, total_optimizer_steps=N_STEPS)
    actor.load_hf_state_dict(load_hf_state_dict(hf_dir))
    return actor


def main(mode: str, out: Path, hf_dir: Path, ckpt_root: Path | None = None) -> None:
    from areal_mcore.actor.checkpoint import CheckpointConfig, Checkpointer
    from areal_mcore.convert.tools import mcore_to_hf
    from areal_mcore.model.mcore_compat import MCORE_VERSION_STR

    out.mkdir(parents=True, exist_ok=True)
    result = {"megatron_core": MCORE_VERSION_STR, "torch": torch.__version__,
              "python": sys.version.split()[0], "losses": []}
    actor = _actor(hf_dir)
    ckpt = Checkpointer(CheckpointConfig(root=str(ckpt_root or out / "ckpt")), dist.group.WORLD)
    if mode == "train":
        for step in range(SAVE_AT):
            result["losses"] += actor.train_batch(_batch(step), ppo_loss, 2)["loss"]
        ckpt.save(actor, step=SAVE_AT, weight_version=SAVE_AT)
    mcore_to_hf(ckpt.latest(), out / "hf", progress=False)
    if mode == "resume":
        try:
            ckpt.load(actor)
        except ValueError as e:  # a refusal is a result: the test checks its message
            result["refused"] = str(e)
            (out / "result.json").write_text(json.dumps(result))
            return
    for step in range(SAVE_AT, N_STEPS):
        result["losses"] += actor.train_batch(_batch(step), ppo_loss, 2)["loss"]
    save_file(actor.hf_state_dict(), str(out / "final.safetensors"))
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]),
             Path(sys.argv[4]) if len(sys.argv) > 4 else None)
    finally:
        dist.destroy_process_group()
