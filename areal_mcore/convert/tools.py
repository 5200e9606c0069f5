"""The two conversions behind ``tools/convert_ckpt`` and ``areal-mcore convert``.

- ``mcore_to_hf``: a training checkpoint (any TP/PP) -> HF folder, streamed a layer at a
  time (peak memory ≈ one shard + one layer, or the read of the largest stored tensor,
  whichever is larger), on CPU.
- ``hf_to_mcore``: an HF folder -> a step-0 training checkpoint at a chosen TP/PP/EP,
  written by real megatron ranks so that a run at that layout resumes from it directly.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from areal_mcore.convert.hf_files import hf_tensor_names, load_hf_state_dict
from areal_mcore.convert.hf_writer import (
    TOKENIZER_MARKERS,
    ShardedSafetensorsWriter,
    has_tokenizer,
    write_model_files,
)
from areal_mcore.convert.mcore_reader import McoreCheckpointReader
from areal_mcore.model import adapter
from areal_mcore.model.args import ModelArgs, args_mismatch, check_expert_parallel
from areal_mcore.net import free_port
from areal_mcore.run_dir import latest_checkpoint


def _hf_config_from_dict(d: dict):
    from transformers import AutoConfig

    d = dict(d)
    return AutoConfig.for_model(d.pop("model_type"), **d)


def _load_hf_config(path: str | Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def mcore_to_hf(input: str | Path, output: str | Path, *, hf_config_dir: str | Path | None = None,
                tokenizer_dir: str | Path | None = None, dtype: str | None = None,
                max_shard_bytes: int = 2 << 30, verify: bool = False, progress: bool = True,
                require_tokenizer: bool = False) -> dict:
    """Exports a checkpoint folder (or a root with ``latest``) as an HF model folder.

    Args:
        hf_config_dir: an HF folder whose config.json must describe the same model (the
            original base model, say); every differing field is reported before writing.
            Default: the HF config stored in the checkpoint.
        tokenizer_dir: where to copy tokenizer files and generation_config.json from
            (default: the first of ``hf_config_dir`` and the models the checkpoint's
            run or import started from that holds a tokenizer: ``tokenizer_source``).
        require_tokenizer: refuse, before writing, an export no tokenizer is found for
            (the CLI does, unless ``--no-tokenizer``).
        dtype: "bfloat16"/"float16"/"float32" to cast to; default: as stored.
        verify: reload the folder with transformers and compare logits with megatron's.

    Returns:
        The safetensors index (``weight_map`` names every tensor).
    """
    reader = McoreCheckpointReader.resolve(input)
    if hf_config_dir is not None:
        hf_config = _load_hf_config(hf_config_dir)
    else:
        hf_config = _hf_config_from_dict(reader.manifest["hf_config"])
    diff = args_mismatch(reader.args, ModelArgs.from_hf(hf_config), "checkpoint", "HF config")
    if diff:
        raise ValueError(f"HF config does not match {reader.path} ({diff}); nothing was written")
    reader.check_keys()
    tokenizer_dir = tokenizer_source(reader, tokenizer_dir, hf_config_dir)
    if tokenizer_dir is None and require_tokenizer:
        raise ValueError(f"no tokenizer for the export of {reader.path}: neither --hf-config nor the models "
                         f"its manifest names ({', '.join(_snapshot_models(reader)) or 'none'}) hold one "
                         f"({' / '.join(TOKENIZER_MARKERS)}). Pass --tokenizer DIR (the model the run "
                         "started from), or --no-tokenizer to export the weights alone; nothing was written")
    out = Path(output)
    writer = ShardedSafetensorsWriter(out, max_shard_bytes, getattr(torch, dtype) if dtype else None)
    L = reader.args.num_layers
    # The two ends hold the vocab matrices (embedding, lm head), the largest tensors and
    # the costliest reads: take them first, each into its own shard, while the writer's
    # buffer is empty; the peak is then max(vocab read, one shard + one layer).
    ends = [L - 1, 0] if L > 1 else [0]
    written = []
    for layer in _progress(ends + list(range(1, L - 1)), L, "layers", progress):
        tensors = reader.read_layer(layer)
        writer.add(tensors)
        written += tensors
        del tensors
        if layer in ends:
            writer.flush()
    adapter.check_hf_names(written, reader.args, f"export of {reader.path}")
    index = writer.close()
    write_model_files(out, hf_config, tokenizer_dir)
    if verify:
        verify_hf_folder(out, reader)
    return index


def _snapshot_models(reader: McoreCheckpointReader) -> list[str]:
    """The model folders a checkpoint's manifest names: the run's tokenizer_path and
    model_path (its resolved config), or the HF folder ``hf-to-mcore`` imported."""
    snapshot = reader.manifest.get("config") or {}
    return [snapshot[k] for k in ("tokenizer_path", "model_path", "imported_from") if snapshot.get(k)]


def tokenizer_source(reader: McoreCheckpointReader, tokenizer_dir: str | Path | None,
                     hf_config_dir: str | Path | None) -> Path | None:
    """Where the export's tokenizer comes from: ``tokenizer_dir`` if given (it must hold
    one), else the first of ``hf_config_dir`` and the manifest's models that holds one."""
    if tokenizer_dir is not None:
        if not has_tokenizer(tokenizer_dir):
            raise ValueError(f"--tokenizer={tokenizer_dir}: no tokenizer there ({' / '.join(TOKENIZER_MARKERS)})")
        return Path(tokenizer_dir)
    candidates = [hf_config_dir, *_snapshot_models(reader)]
    return next((Path(c) for c in candidates if c is not None and has_tokenizer(c)), None)


def _progress(iterable, total: int, unit: str, enabled: bool):
    if not enabled:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, unit=unit)


def verify_hf_folder(folder: str | Path, reader: McoreCheckpointReader, n_tokens: int = 64,
                     atol: float = 1e-3) -> float:
    """Max |logit difference| between transformers on ``folder`` and the megatron model
    holding the checkpoint's weights, on random tokens; raises above ``atol``.

    64 tokens, since RoPE scaling (Llama 3) changes only the slow frequencies: on the tiny
    llama3 of the tests, dropping it moves the logits by 1.2e-3 at 16 tokens, 7e-3 at 64."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True,
                                              dtype=torch.float32).eval()
    tokens = torch.randint(0, reader.args.vocab_size, (1, n_tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens).logits[0]
    got = _megatron_logits(reader, tokens[0])
    err = float((got - expected).abs().max())
    if err > atol:
        raise ValueError(f"--verify: logits differ by {err:.2e} (> {atol}) between megatron and the export")
    return err


def _megatron_logits(reader: McoreCheckpointReader, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of a single-process megatron model (TP = PP = 1) loaded with the weights."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from areal_mcore.actor.config import ParallelConfig
    from areal_mcore.actor.parallel import init_parallel
    from areal_mcore.devices import bind_local_device
    from areal_mcore.model.args import padded_vocab_size
    from areal_mcore.model.hf_config import build_gpt_model, transformer_config

    args = reader.args
    own_group = not dist.is_initialized()
    if own_group:
        bind_local_device()  # this process is rank 0 of its own world  # megatron's layers want a process group: a world of one
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    init_parallel(ParallelConfig(), seed=1)
    try:
        vocab = padded_vocab_size(args.vocab_size, 1)
        config = transformer_config(args, tp_size=1, pp_size=1, params_dtype=torch.float32)
        model = build_gpt_model(args, config, padded_vocab=vocab, use_te=False, pre_process=True,
                                post_process=True).eval()
        hf = {}
        for tensors in reader.iter_layers():
            hf.update({k: v.float() for k, v in tensors.items()})
        local = adapter.from_hf(hf, args, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, padded_vocab=vocab)
        model.load_state_dict(local, strict=False)
        with torch.no_grad():
            logits = model(tokens[None], torch.arange(len(tokens))[None], attention_mask=None)
        return logits[0, :, : args.vocab_size]
    finally:
        mpu.destroy_model_parallel()
        if own_group:
            dist.destroy_process_group()


# --------------------------------------------------------------------------- HF -> mcore


def hf_to_mcore(input: str | Path, output: str | Path, *, tp: int = 1, pp: int = 1, ep: int = 1,
                dtype: str = "float32", vocab_divisible_by: int = 128) -> Path:
    """Writes a step-0 training checkpoint of the HF model at TP x PP x EP (tp*pp*ep CPU
    ranks: EP is carved out of data parallelism, so its ranks are the data-parallel ones),
    its vocabulary padded as the run's ``actor.vocab_divisible_by`` pads it (the padded
    embedding and its optimizer state are saved at that shape)."""
    import torch.multiprocessing as mp

    # Fail early, in this process, on a bad folder: config, EP split, then every weight name.
    args = ModelArgs.from_hf(_load_hf_config(input))
    check_expert_parallel(args, ep, key="--ep")
    names = [n for n in hf_tensor_names(input) if not (args.tie_word_embeddings and n == "lm_head.weight")]
    adapter.check_hf_names(names, args, str(input))
    port = free_port()
    world = tp * pp * ep
    # The ranks fork from a server that imported the actor once, where each spawned rank
    # imported torch and megatron-core itself (8 s of CPU apiece on 2 cores). A forkserver,
    # not fork: this process may have run torch's OpenMP threads (a test, a notebook), which
    # a forked child inherits broken; the server only imports. Where the server already runs
    # (a second conversion in one process), the preload list is ignored and ranks import
    # what they lack (multiprocessing/forkserver.py, ensure_running).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["areal_mcore.convert._rank_imports"])
    mp.start_processes(_hf_to_mcore_rank, args=(world, port, str(input), str(output), tp, pp, ep, dtype,
                                                vocab_divisible_by),
                       nprocs=world, start_method="forkserver")
    return latest_checkpoint(output)


def _hf_to_mcore_rank(rank, world, port, input, output, tp, pp, ep, dtype, vocab_divisible_by):
    import torch.distributed as dist

    import areal_mcore.convert._rank_imports  # noqa: F401 - the warning filters, if not preloaded
    from areal_mcore.actor.checkpoint import CheckpointConfig, Checkpointer
    from areal_mcore.actor.config import (
        ActorConfig,
        MicroBatchSpec,
        OptimizerConfig,
        ParallelConfig,
    )
    from areal_mcore.actor.megatron_actor import MegatronActor
    from areal_mcore.devices import bind_local_device

    # One thread a rank unless the user says otherwise; set here, not in the environment:
    # torch (and OpenMP with it) was loaded in the forkserver, before this rank existed.
    torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))
    bind_local_device({"LOCAL_RANK": str(rank)})  # forked here, all on this node
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        hf_config = _load_hf_config(input)
        cfg = ActorConfig(mb_spec=MicroBatchSpec(max_tokens_per_mb=1), optimizer=OptimizerConfig(lr=1e-5),
                          parallel=ParallelConfig(tp=tp, pp=pp, ep=ep), dtype=dtype,
                          vocab_divisible_by=vocab_divisible_by)
        actor = MegatronActor(cfg, hf_config)
        state = load_hf_state_dict(input)
        # transformers drops the lm head of tied models from the files: ignore a stray one.
        if actor.args.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        adapter.check_hf_names(state, actor.args, str(input))
        actor.load_hf_state_dict(state)
        Checkpointer(CheckpointConfig(root=output), dist.group.WORLD).save(
            actor, step=0, weight_version=0, config_snapshot={"imported_from": str(input)}, weights_only=True)
    finally:
        dist.destroy_process_group()
