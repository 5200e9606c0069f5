"""``areal-mcore``: the command-line entry point."""

from __future__ import annotations

import argparse
import json
import re
import sys


def parse_size(text: str) -> int:
    """'2GB', '500MB', '64KiB' or a byte count -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 2GB, 500MB or 1048576")
    number, unit, suffix = float(m.group(1)), m.group(2).upper(), (m.group(3) or "").lower()
    base = 1024 if suffix == "ib" or not suffix else 1000
    return int(number * base ** " KMGT".index(unit or " "))


def add_convert_parsers(sub) -> None:
    convert = sub.add_parser(
        "convert", help="convert checkpoints between megatron (any TP/PP) and HF",
        description="Convert training checkpoints to HF folders and back.")
    kinds = convert.add_subparsers(dest="direction", required=True)

    out = kinds.add_parser(
        "mcore-to-hf", help="training checkpoint -> HF safetensors folder",
        description="Export a training checkpoint (saved at any TP/PP) as an HF folder: "
                    "config.json, sharded model-*.safetensors + index, generation config and "
                    "tokenizer files. Streams one layer at a time; no GPU needed.")
    out.add_argument("--input", required=True, help="checkpoint folder (step_XXXXXXXX) or a root with 'latest'")
    out.add_argument("--output", required=True, help="HF folder to write")
    out.add_argument("--hf-config", help="HF folder whose config.json must match the checkpoint "
                                         "(default: the config stored in the checkpoint)")
    out.add_argument("--tokenizer", help="folder to copy tokenizer files from (default: --hf-config)")
    out.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast weights (default: as stored)")
    out.add_argument("--max-shard-size", type=parse_size, default=parse_size("2GB"),
                     help="largest safetensors shard, e.g. 2GB (default), 500MB")
    out.add_argument("--verify", action="store_true",
                     help="reload with transformers and compare logits with the megatron model")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")

    inp = kinds.add_parser(
        "hf-to-mcore", help="HF folder -> step-0 training checkpoint at a TP/PP layout",
        description="Import an HF Qwen2/LLaMA folder as a training checkpoint at the given "
                    "TP x PP (written by tp*pp CPU ranks), to start a long run from it.")
    inp.add_argument("--input", required=True, help="HF model folder")
    inp.add_argument("--output", required=True, help="checkpoint root to write (gets 'latest')")
    inp.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the run")
    inp.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the run")
    inp.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")


def run_convert(a) -> int:
    from areal_mcore.convert.tools import hf_to_mcore, mcore_to_hf

    if a.direction == "mcore-to-hf":
        index = mcore_to_hf(a.input, a.output, hf_config_dir=a.hf_config, tokenizer_dir=a.tokenizer,
                            dtype=a.dtype, max_shard_bytes=a.max_shard_size, verify=a.verify,
                            progress=not a.no_progress)
        files = len(set(index["weight_map"].values()))
        print(f"wrote {len(index['weight_map'])} tensors in {files} shard(s) to {a.output}"
              + (" (verified)" if a.verify else ""))
    else:
        path = hf_to_mcore(a.input, a.output, tp=a.tp, pp=a.pp, dtype=a.dtype)
        print(f"wrote {path} (tp={a.tp}, pp={a.pp})")
    return 0


def add_filter_parsers(sub) -> None:
    filt = sub.add_parser("filter", help="boba's dataset filters (difficulty, prompt length)",
                          description="Filter a boba-format JSONL dataset; kept rows are copied unchanged.")
    kinds = filt.add_subparsers(dest="kind", required=True)
    diff = kinds.add_parser(
        "difficulty", help="drop problems the base model solves in all k of k samples",
        description="Score k precomputed samples per problem with the boba reward and drop the "
                    "problems solved every time (boba: k = 8). Sampling from a rollout endpoint "
                    "arrives with the rollout issue.")
    diff.add_argument("--data", required=True, help="boba-format JSONL")
    diff.add_argument("--samples", required=True,
                      help='JSONL, one row per problem in order: {"completions": [k strings]}')
    diff.add_argument("--k", type=int, default=8)
    diff.add_argument("--out", required=True)
    diff.add_argument("--workers", type=int, default=2, help="reward worker processes")
    length = kinds.add_parser("length", help="drop problems whose prompt is too long",
                              description="Drop problems whose chat-templated prompt exceeds --max-prompt-tokens.")
    length.add_argument("--data", required=True)
    length.add_argument("--tokenizer", required=True, help="folder for AutoTokenizer.from_pretrained")
    length.add_argument("--max-prompt-tokens", type=int, default=1024)
    length.add_argument("--out", required=True)
    for p in (diff, length):
        p.add_argument("--skip-bad-rows", action="store_true", help="skip and count malformed rows")


def run_filter(a) -> int:
    from areal_mcore.data.filters import difficulty_filter, length_filter
    from areal_mcore.data.jsonl import DatasetConfig

    cfg = DatasetConfig(path=a.data, skip_bad_rows=a.skip_bad_rows)
    if a.kind == "difficulty":
        from areal_mcore.reward.pool import RewardPool, RewardPoolConfig

        with RewardPool(RewardPoolConfig(num_workers=a.workers)) as pool:
            summary = difficulty_filter(cfg, a.samples, a.out, k=a.k, pool=pool)
    else:
        from transformers import AutoTokenizer

        from areal_mcore.data.prompts import BOBA_SUFFIX

        tok = AutoTokenizer.from_pretrained(a.tokenizer, local_files_only=True)
        summary = length_filter(cfg, tok, a.out, max_prompt_tokens=a.max_prompt_tokens, suffix=BOBA_SUFFIX)
    print(json.dumps(summary))
    return 0


def add_train_parsers(sub) -> None:
    for name, what in (("train", "boba PPO: rollout servers, rewards, megatron actor, weight sync"),
                       ("sft", "supervised warm-up of a base model on the dataset's solutions")):
        p = sub.add_parser(name, help=what, description=f"{what}. Launch with torchrun for "
                           "several ranks; a plain call runs one rank.",
                           epilog="example: areal-mcore train --config configs/tiny_cpu.yaml "
                                  "trainer.total_steps=20 actor.optimizer.lr=1e-5")
        p.add_argument("--config", required=True, help="YAML file under configs/")
        p.add_argument("overrides", nargs="*", help="a.b.c=value overrides, applied after the file")


def _init_distributed() -> None:
    """From torchrun's environment, else a one-rank group on this machine."""
    import os

    import torch
    import torch.distributed as dist

    from areal_mcore.rollout.launcher import free_port

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def run_train(a) -> int:
    from areal_mcore.config import load_config

    cfg = load_config(a.config, a.overrides)  # config errors surface before any process group
    _init_distributed()
    if a.command == "sft":
        from areal_mcore.trainer.sft import run_sft

        losses = run_sft(cfg)
        print(f"sft: NLL {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; "
              f"model written to {cfg.sft.output_dir}")
    else:
        from areal_mcore.trainer.ppo import train

        history = train(cfg)
        print(f"train: {len(history)} steps; stats in {cfg.trainer.log_dir}/{cfg.experiment_name}/stats.jsonl")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="areal-mcore", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_convert_parsers(sub)
    add_filter_parsers(sub)
    add_train_parsers(sub)
    a = parser.parse_args(argv)
    try:
        return {"convert": run_convert, "filter": run_filter, "train": run_train,
                "sft": run_train}[a.command](a)
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"areal-mcore {a.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
