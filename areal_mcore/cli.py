"""``areal-mcore``: the command-line entry point."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


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
    from areal_mcore.paths import PathError, check_hf_model, check_writable_dir

    check_writable_dir("--output", a.output)
    if a.direction == "mcore-to-hf":
        if not Path(a.input).is_dir():
            raise PathError(f"--input={a.input}: no such folder; expected a checkpoint folder "
                            "(step_XXXXXXXX) or a checkpoint root with 'latest'")
        if a.hf_config:
            check_hf_model("--hf-config", a.hf_config, weights=False)
    else:
        check_hf_model("--input", a.input)
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
        description="Sample k responses per problem from --model (servers launched as eval launches "
                    "them) or from running servers (--server-url), or take precomputed ones "
                    "(--samples); score them with the boba reward and drop the problems solved every "
                    "time (boba: k = 8 from the base model). Sampling is resumable: finished problems "
                    "are kept in OUT.samples.jsonl and a rerun samples only the others.",
        epilog="example: areal-mcore filter difficulty --model runs/tiny-cpu/sft_model --data "
               "runs/tiny-cpu/assets/train.jsonl --k 8 --max-new-tokens 24 --out train.filtered.jsonl")
    diff.add_argument("--data", required=True, help="boba-format JSONL")
    source = diff.add_mutually_exclusive_group(required=True)
    source.add_argument("--samples", help='JSONL, one row per problem in order: {"completions": [k strings]}')
    source.add_argument("--model", help="HF folder to sample from (servers are launched here)")
    source.add_argument("--server-url", type=_csv(str), help="comma-separated host:port of running servers")
    diff.add_argument("--k", type=int, default=8)
    diff.add_argument("--out", required=True)
    diff.add_argument("--workers", type=int, default=2, help="reward worker processes")
    diff.add_argument("--tokenizer", help="tokenizer folder (default: --model)")
    diff.add_argument("--model-kind", choices=["rl", "sft", "base"], default="base",
                      help="sets the sampling as eval does (default base: temperature 0.6, top_p 0.95)")
    diff.add_argument("--temperature", type=float, help="override the model kind's temperature")
    diff.add_argument("--top-p", type=float, help="override the model kind's top_p")
    diff.add_argument("--max-new-tokens", type=int, default=27648, help="response budget (default: boba's 27648)")
    diff.add_argument("--context-length", type=int, default=32768, help="of the servers launched here")
    diff.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                      help="weights of the servers launched here")
    diff.add_argument("--seed", type=int, default=1)
    diff.add_argument("--chunk", type=int, default=64,
                      help="problems in flight between two appends to OUT.samples.jsonl")
    diff.add_argument("--no-progress", action="store_true", help="no progress bar")
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
    from areal_mcore.paths import check_readable_file, check_tokenizer

    if a.kind == "difficulty" and a.samples is None:
        return _filter_by_sampling(a)
    _check_filter_data(a)
    if a.kind == "difficulty":
        check_readable_file("--samples", a.samples, "a JSONL file of completions")
    else:
        check_tokenizer("--tokenizer", a.tokenizer)
    cfg = DatasetConfig(path=a.data, skip_bad_rows=a.skip_bad_rows)
    if a.kind == "difficulty":
        from areal_mcore.reward.pool import RewardPool, RewardPoolConfig

        with RewardPool(RewardPoolConfig(num_workers=a.workers)) as pool:
            summary = difficulty_filter(cfg, a.samples, a.out, k=a.k, pool=pool)
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(a.tokenizer, local_files_only=True)
        summary = length_filter(cfg, tok, a.out, max_prompt_tokens=a.max_prompt_tokens, suffix=cfg.instruction)
    print(json.dumps(summary))
    return 0


def _check_filter_data(a) -> None:
    from areal_mcore.paths import check_dataset, check_writable_dir

    check_dataset("--data", a.data)
    if Path(a.data).suffix.lower() != ".jsonl" or not Path(a.data).is_file():
        # Kept rows are copied byte for byte, which only a JSONL file's lines allow.
        raise ValueError(f"--data={a.data}: the filters read and write one JSONL file; write the dataset "
                         "as JSONL first (datasets: Dataset.to_json(path, lines=True))")
    check_writable_dir("--out", str(Path(a.out).parent))


def _filter_by_sampling(a) -> int:
    from areal_mcore.data.jsonl import DatasetConfig
    from areal_mcore.eval.difficulty import DifficultyConfig, filter_by_sampling
    from areal_mcore.paths import check_hf_model, check_tokenizer
    from areal_mcore.reward.pool import RewardPoolConfig
    from areal_mcore.rollout.config import ServerConfig

    _check_filter_data(a)
    model = a.model or a.tokenizer
    if a.model:
        check_hf_model("--model", a.model)
    elif not a.tokenizer:
        raise ValueError("--server-url needs --tokenizer FOLDER (the model's tokenizer, to build prompts)")
    check_tokenizer("--tokenizer" if a.tokenizer else "--model", a.tokenizer or a.model)
    server = ServerConfig(model_path=model, dtype=a.dtype, context_length=a.context_length,
                          addresses=[u.removeprefix("http://") for u in a.server_url or []])
    cfg = DifficultyConfig(dataset=DatasetConfig(path=a.data, skip_bad_rows=a.skip_bad_rows), out=a.out,
                           server=server, k=a.k, model_kind=a.model_kind, temperature=a.temperature,
                           top_p=a.top_p, max_new_tokens=a.max_new_tokens, tokenizer_path=a.tokenizer,
                           seed=a.seed, chunk=a.chunk, reward=RewardPoolConfig(num_workers=a.workers),
                           progress=not a.no_progress)
    print(json.dumps(filter_by_sampling(cfg)))
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
        p.add_argument("--no-plan-check", action="store_true",
                       help="start even when `areal-mcore plan` says the config does not fit in GPU memory")


def add_plan_parsers(sub) -> None:
    from areal_mcore.plan import GPUS_GB

    p = sub.add_parser(
        "plan", help="will the config fit in GPU memory? per trainer rank and rollout server",
        description="Predict the memory of every trainer rank (weights, main params, grads, optimizer "
                    "shard, activations of the micro-batches in flight, logits, weight-sync buffers, "
                    "margin) and of a rollout server (weights, KV-cache tokens, sequences that fit). "
                    "Exit status 0 when everything fits, 1 when not (with the knobs that would fix it).",
        epilog="example: areal-mcore plan --config configs/boba_32b_ppo.yaml --gpu h100 actor.recompute=false")
    p.add_argument("--config", required=True, help="YAML file under configs/")
    p.add_argument("overrides", nargs="*", help="a.b.c=value overrides, applied after the file")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--gpu-memory-gb", type=float, help="memory per GPU (default: plan.gpu_memory_gb)")
    size.add_argument("--gpu", choices=sorted(GPUS_GB), help="memory per GPU of a known GPU")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def run_plan(a) -> int:
    from areal_mcore.config import load_config
    from areal_mcore.plan import GPUS_GB, format_table, make_plan, to_json

    cfg = load_config(a.config, a.overrides)
    plan = make_plan(cfg, GPUS_GB[a.gpu] if a.gpu else a.gpu_memory_gb)
    print(json.dumps(to_json(plan), indent=1) if a.json else format_table(plan))
    return 0 if plan.fits else 1


def run_verify_checkpoint(a) -> int:
    from areal_mcore.run_dir import verify_checkpoint

    bad = 0
    for path in a.checkpoints:
        if not (Path(path) / "manifest.json").is_file():
            raise FileNotFoundError(f"{path}: no manifest.json (give a checkpoints/step_* folder)")
        problems = verify_checkpoint(Path(path))
        bad += bool(problems)
        print(f"{path}: " + ("OK" if not problems else "DAMAGED\n  " + "\n  ".join(problems)))
    return 1 if bad else 0


def refuse_unplanned(cfg, command: str) -> bool:
    """Prints the plan and returns True when ``cfg`` cannot fit (before anything starts)."""
    from areal_mcore.plan import refusal

    why = refusal(cfg)
    if why:
        print(f"areal-mcore {command}: {why}", file=sys.stderr)
    return why is not None


def _init_distributed() -> None:
    """From torchrun's environment, else a one-rank group on this machine. The rank is
    bound to its GPU (``LOCAL_RANK``) first: NCCL and megatron use the current device."""
    import os

    import torch
    import torch.distributed as dist

    from areal_mcore.devices import bind_local_device
    from areal_mcore.net import free_port, set_nccl_env

    bind_local_device()
    set_nccl_env(os.environ)  # before NCCL reads it
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def run_train(a) -> int:
    from areal_mcore.config import load_config
    from areal_mcore.paths import check_run_paths

    overrides = a.overrides + (["plan.check=false"] if a.no_plan_check else [])
    cfg = load_config(a.config, overrides)  # config errors surface before any process group
    if refuse_unplanned(cfg, a.command):  # ... and a config that cannot fit, before any server
        return 2
    check_run_paths(cfg, a.command)  # and wrong paths, before any rank or server starts
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


def _csv(kind):
    """argparse type for comma-separated values: 'a.jsonl,b.jsonl', '1,8,32'."""
    def parse(text: str):
        items = [t.strip() for t in text.split(",") if t.strip()]
        try:
            return [kind(t) for t in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {kind.__name__}") from None
    return parse


def add_eval_parsers(sub) -> None:
    from areal_mcore.data.jsonl import FORMATS, THINK_MODES
    from areal_mcore.eval.config import MODEL_KINDS

    p = sub.add_parser(
        "eval", help="pass@k over n samples per problem, with boba's eval settings",
        description="Sample --n-samples responses per problem from rollout servers (launched here "
                    "with boba's long-context settings, or running at --server-url), score them with "
                    "the boba reward and report pass@1 (averaged over samples) and unbiased pass@k "
                    "per dataset, as a table and as JSON (--out).",
        epilog="example: areal-mcore eval --config configs/tiny_cpu.yaml --model runs/tiny-cpu/hf/step_300 "
               "--data runs/tiny-cpu/assets/test.jsonl --model-kind rl --n-samples 8 --out eval.json")
    p.add_argument("--config", help="YAML under configs/ whose model_path, tokenizer_path, server, reward, "
                                    "seed, rollout.max_new_tokens and eval_dataset are the defaults")
    p.add_argument("overrides", nargs="*", help="a.b.c=value overrides of --config, e.g. server.tp_size=4")
    p.add_argument("--model", help="HF folder to evaluate (default: the config's model_path)")
    p.add_argument("--tokenizer", help="tokenizer folder (default: the config's tokenizer_path, else --model)")
    p.add_argument("--data", type=_csv(str), help="comma-separated JSONL files, one report row each "
                                                  "(default: the config's eval_dataset)")
    p.add_argument("--data-format", choices=FORMATS,
                   help="row format of --data; mc = multiple choice {question, choices, answer} "
                        "(default: the config's eval_dataset format, else boba)")
    p.add_argument("--model-kind", required=True, choices=MODEL_KINDS,
                   help="sets the sampling: rl 1.0/1.0, sft and base 0.6/0.95 (temperature/top_p)")
    p.add_argument("--n-samples", type=int, default=32, help="samples per problem (default 32)")
    p.add_argument("--temperature", type=float, help="override the model kind's temperature")
    p.add_argument("--top-p", type=float, help="override the model kind's top_p")
    p.add_argument("--k", type=_csv(int), dest="ks",
                   help="pass@k to report, e.g. 1,8,32 (default: powers of two up to n, and n)")
    p.add_argument("--max-new-tokens", type=int, help="response budget (default: the config's "
                                                      "rollout.max_new_tokens, else 27648)")
    p.add_argument("--shuffle-choices", action="store_true",
                   help="permute multiple-choice options per problem (seeded); GPQA's gold is always A")
    p.add_argument("--prompt-suffix", help="a different instruction after each question than training "
                                           "used ('' for none); default: the dataset's instruction, "
                                           "as in training (auto: boba's where the row has none)")
    p.add_argument("--think", choices=THINK_MODES,
                   help="start responses with '<think>\\n' (auto: where the chat template has thinking); "
                        "default: the dataset's setting, as in training")
    p.add_argument("--max-prompt-tokens", type=int, help="drop (and count) longer prompts (default: the "
                                                         "config's trainer.max_prompt_tokens, else keep all)")
    p.add_argument("--seed", type=int, help="sampling and shuffling seed (default: the run's eval seed "
                                            "rollout.seed+1 with --config, else 1)")
    p.add_argument("--backend", choices=("sglang", "vllm", "embedded"),
                   help="the servers' engine (default: the config's server.backend, else embedded)")
    p.add_argument("--server-url", type=_csv(str), help="comma-separated host:port of running servers "
                                                        "(nothing is launched)")
    p.add_argument("--out", help="write the JSON report here")


def _check_eval_paths(a, model: str, exp, datasets) -> None:
    """Model, tokenizer, data and report paths, before any server starts."""
    from areal_mcore.paths import check_dataset, check_hf_model, check_tokenizer, check_writable_dir

    model_key = "--model" if a.model else "model_path"
    if not a.server_url:  # running servers may hold a model this machine has no copy of
        check_hf_model(model_key, model)
    tokenizer = a.tokenizer or (exp.tokenizer_path if exp else None)
    check_tokenizer(("--tokenizer" if a.tokenizer else "tokenizer_path") if tokenizer else model_key,
                    tokenizer or model)
    for d in datasets:
        check_dataset("--data" if a.data else "eval_dataset.path", d.path)
    if a.out:
        check_writable_dir("--out", str(Path(a.out).parent))


def run_eval(a) -> int:
    import dataclasses

    from areal_mcore.data.jsonl import DatasetConfig
    from areal_mcore.eval import EvalConfig, evaluate, format_table
    from areal_mcore.eval.config import DEFAULT_MAX_NEW_TOKENS
    from areal_mcore.reward.pool import RewardPoolConfig
    from areal_mcore.rollout.config import ServerConfig

    if a.overrides and not a.config:
        raise ValueError(f"overrides {a.overrides} change a config file's values: give --config too")
    exp = None
    if a.config:
        from areal_mcore.config import load_config

        exp = load_config(a.config, a.overrides)
    model = a.model or (exp.model_path if exp else None)
    if not model:
        raise ValueError("no model to evaluate: give --model HF_FOLDER (or --config with model_path)")
    # --data rows are read and prompted as the run's eval set is (format, instruction,
    # thinking prefix), unless a flag says otherwise.
    base = (exp.eval_dataset or exp.dataset) if exp else None
    if a.data:
        fmt = a.data_format or (base.format if base else "boba")
        keep = base if base and base.format == fmt else None
        datasets = [dataclasses.replace(keep, path=path) if keep else DatasetConfig(path=path, format=fmt)
                    for path in a.data]
    elif exp and exp.eval_dataset:
        datasets = [exp.eval_dataset]
    else:
        raise ValueError("no dataset to evaluate: give --data a.jsonl[,b.jsonl] (or --config with eval_dataset)")
    server = exp.server if exp and exp.server else ServerConfig(model_path=model)
    server = dataclasses.replace(server, model_path=model, backend=a.backend or server.backend,
                                 addresses=[u.removeprefix("http://") for u in a.server_url or []]
                                 or server.addresses)
    cfg = EvalConfig(
        datasets=datasets, server=server, model_kind=a.model_kind, n_samples=a.n_samples,
        max_new_tokens=a.max_new_tokens or (exp.rollout.max_new_tokens if exp and exp.rollout
                                            else DEFAULT_MAX_NEW_TOKENS),
        tokenizer_path=a.tokenizer or (exp.tokenizer_path if exp else None),
        temperature=a.temperature, top_p=a.top_p, ks=a.ks, shuffle_choices=a.shuffle_choices,
        prompt_suffix=a.prompt_suffix, force_think=a.think,
        max_prompt_tokens=a.max_prompt_tokens or (exp.trainer.max_prompt_tokens if exp and exp.trainer else None),
        # The run's periodic eval samples with rollout.seed + 1 (trainer/ppo.py): the same
        # seeds draw the same samples from the same weights.
        seed=a.seed if a.seed is not None else (exp.rollout.seed + 1 if exp and exp.rollout else 1),
        reward=exp.reward if exp else RewardPoolConfig(), out=a.out)
    _check_eval_paths(a, model, exp, datasets)
    report = evaluate(cfg)
    print(format_table(report))
    if a.out:
        print(f"report written to {a.out}")
    return 0


def add_launch_parsers(sub) -> None:
    p = sub.add_parser(
        "launch", help="submit a run to Slurm through submitit (requeue, sweeps)",
        description="Submit a run as a submitit Slurm job that runs the in-allocation launcher "
                    "(rollout servers + trainer steps, launch.allocation) and requeues itself on "
                    "time limit or preemption, resuming from its checkpoint.",
        epilog="example: areal-mcore launch --config configs/boba_7b.yaml --nodes 4 --gpus-per-node 8 "
               "--partition gpu --time 72:00:00 --wait launch.allocation=sglang:d16+megatron:d8t2")
    p.add_argument("--config", required=True, help="YAML under configs/")
    p.add_argument("overrides", nargs="*", help="a.b.c=value overrides of the config")
    p.add_argument("--nodes", type=int, required=True, help="nodes of the allocation")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node; 0 for CPU nodes")
    p.add_argument("--partition", help="Slurm partition (default: the cluster's)")
    p.add_argument("--time", default="72:00:00", help="limit of one try, [D-]HH:MM:SS (default 72:00:00)")
    p.add_argument("--folder", default="runs/submitit", help="submitit's logs and pickles")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                   help="one array task per combination of values (repeatable)")
    p.add_argument("--max-restarts", type=int, default=3, help="requeues on time limit before giving up")
    p.add_argument("--wait", action="store_true", help="print state changes until done, then the results")


def run_launch(a) -> int:
    from areal_mcore.launcher.submit import SubmitConfig, submit, wait

    jobs = submit(SubmitConfig(config=a.config, overrides=a.overrides, nodes=a.nodes, gpus_per_node=a.gpus_per_node,
                               partition=a.partition, time=a.time, folder=a.folder, sweep=a.sweep,
                               max_restarts=a.max_restarts))
    print("submitted: " + " ".join(j.job_id for j in jobs), flush=True)
    if a.wait:
        for result in wait(jobs):
            print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="areal-mcore", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_convert_parsers(sub)
    add_filter_parsers(sub)
    add_train_parsers(sub)
    add_eval_parsers(sub)
    add_launch_parsers(sub)
    add_plan_parsers(sub)
    verify = sub.add_parser("verify-checkpoint", help="check checkpoint folders against their manifests' hashes",
                            epilog="example: areal-mcore verify-checkpoint runs/tiny-cpu/checkpoints/step_*")
    verify.add_argument("checkpoints", nargs="+", help="checkpoints/step_* folders")
    a = parser.parse_args(argv)
    from areal_mcore.accel import quiet_known_warnings

    quiet_known_warnings()  # before megatron-core is imported; the actor says it in one line
    from areal_mcore.rollout.protocol import RolloutError
    try:
        return {"convert": run_convert, "filter": run_filter, "train": run_train,
                "sft": run_train, "eval": run_eval, "launch": run_launch, "plan": run_plan,
                "verify-checkpoint": run_verify_checkpoint}[a.command](a)
    except (ValueError, FileNotFoundError) as e:  # user errors; anything else is a bug: traceback
        print(f"areal-mcore {a.command}: error: {e}", file=sys.stderr)
        return 2
    except RolloutError as e:  # the servers failed (none healthy left): what, not where in our code
        print(f"areal-mcore {a.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
