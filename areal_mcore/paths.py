"""Checks of path-valued settings, run before any process group, server or worker starts.

A wrong path otherwise surfaces minutes later as a traceback from deep inside another
library (``transformers`` reads ``model_path=/nonexistent`` as a malformed hub repo id,
on every rank). Each check raises :class:`PathError` (a ``ValueError``, so the CLI exits 2
with one line) naming the key, the value and what was expected there.

``check_run_paths`` applies them to an experiment config for the command about to run; it
reads the config's attributes only, so this module imports nothing of the package.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# What counts as model weights in an HF folder (transformers' and SGLang's loaders).
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


class PathError(ValueError):
    """A path-valued setting that cannot be used; the message names the key and the fix."""


def check_hf_model(key: str, value: str | None, *, weights: bool = True) -> None:
    """``value`` is an HF model folder: ``config.json`` and (with ``weights``) weight files."""
    path = _given(key, value, "an HF model folder with config.json and weights")
    if not path.is_dir():
        raise PathError(f"{key}={value}: {_missing_or_kind(path)}; expected an HF model folder with "
                        "config.json and *.safetensors weights (e.g. the output of `areal-mcore sft` "
                        "or `areal-mcore convert mcore-to-hf`)")
    if not (path / "config.json").is_file():
        raise PathError(f"{key}={value}: the folder has no config.json; expected an HF model folder "
                        "with config.json and *.safetensors weights")
    if weights and not any(any(path.glob(p)) for p in WEIGHT_PATTERNS):
        raise PathError(f"{key}={value}: the folder has config.json but no weights "
                        f"({' or '.join(WEIGHT_PATTERNS)}); expected an HF model folder with weights "
                        "(save_pretrained writes model.safetensors)")


# config.json keys that fix the parameters' shapes (the reference model reuses the actor's).
SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "intermediate_size", "tie_word_embeddings")


def check_same_architecture(key: str, value: str, other_key: str, other: str) -> None:
    """The HF folders ``value`` and ``other`` (both checked by ``check_hf_model``) hold
    models of the same shapes, by their config.json."""
    import json

    mine, theirs = (json.loads((Path(v) / "config.json").read_text()) for v in (value, other))
    diff = [f"{k}: {mine.get(k)!r} vs {theirs.get(k)!r}" for k in SHAPE_KEYS if mine.get(k) != theirs.get(k)]
    if diff:
        raise PathError(f"{key}={value}: its model differs from {other_key}={other}'s ({'; '.join(diff)}); "
                        f"expected the same architecture (the reference model is sharded and loaded like "
                        f"the actor): point {key} at a checkpoint of the same model, or set it to null")


def check_tokenizer(key: str, value: str | None) -> None:
    """``value`` is a folder with tokenizer files (``AutoTokenizer.from_pretrained``)."""
    path = _given(key, value, "a folder with tokenizer files")
    if not path.is_dir():
        raise PathError(f"{key}={value}: {_missing_or_kind(path)}; expected a folder with tokenizer "
                        f"files ({', '.join(TOKENIZER_FILES)})")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise PathError(f"{key}={value}: the folder has no tokenizer file ({', '.join(TOKENIZER_FILES)}); "
                        "set the key to the folder the tokenizer was saved to")


def check_readable_file(key: str, value: str | None, what: str = "a readable file") -> None:
    path = _given(key, value, what)
    if not path.is_file():
        raise PathError(f"{key}={value}: {_missing_or_kind(path)}; expected {what}")
    _try_read(key, value, path, what)


def check_dataset(key: str, value: str | None) -> None:
    """``value`` is a JSONL/JSON/Parquet file, a folder holding such files, or a hub id.

    A value that is no local path but looks like ``owner/name`` is left to
    ``datasets.load_dataset`` (its cache, or the hub), which reports it by name.
    """
    expected = ("a JSONL, JSON or Parquet file, a folder of them (or one saved by "
                "datasets.save_to_disk), or a hub dataset id owner/name")
    path = _given(key, value, expected)
    if not path.exists():
        if is_hub_id(value):
            return
        raise PathError(f"{key}={value}: no such file or folder; expected {expected}")
    if path.is_dir():
        files = data_files(path)
        if not files:
            raise PathError(f"{key}={value}: the folder holds no {'/'.join(DATA_SUFFIXES)} file and is no "
                            f"datasets.save_to_disk folder; expected {expected}")
        _try_read(key, value, files[0], expected)
        return
    if path.suffix.lower() not in DATA_SUFFIXES:
        raise PathError(f"{key}={value}: {path.suffix or 'no'} extension; expected {expected}")
    _try_read(key, value, path, expected)
    if path.stat().st_size == 0 or (path.suffix.lower() == ".jsonl" and not _has_text(path)):
        raise PathError(f"{key}={value}: the file is empty; expected one problem per line")


def _has_text(path: Path) -> bool:
    """Whether a text file has a non-blank character (read in blocks: datasets are large)."""
    with open(path, "rb") as f:
        while block := f.read(1 << 16):
            if block.strip():
                return True
    return False


def check_writable_dir(key: str, value: str | None) -> None:
    """``value`` is a folder this process can create (if missing) and write into.

    Tried for real with a temporary file in the nearest existing folder: permission bits
    say nothing for root, and read-only mounts pass ``os.access``.
    """
    path = _given(key, value, "a writable folder")
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise PathError(f"{key}={value}: {probe} is a file, not a folder; expected a writable folder")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise PathError(f"{key}={value}: cannot write in {probe} ({e.strerror}); expected a writable "
                        "folder: choose another location or fix its permissions") from None


def check_run_paths(cfg, command: str) -> None:
    """Every path ``areal-mcore train|sft`` will use, checked before anything starts.

    Args:
        cfg: an ``ExperimentConfig``.
        command: ``"train"`` or ``"sft"``.
    """
    if command == "sft":
        sft = cfg.sft
        if sft is None:
            raise PathError("sft needs the config section 'sft' (base_model, output_dir, steps, batch_size)")
        check_hf_model("sft.base_model", sft.base_model)
        check_tokenizer("tokenizer_path" if cfg.tokenizer_path else "sft.base_model",
                        cfg.tokenizer_path or sft.base_model)
        check_writable_dir("sft.output_dir", sft.output_dir)
    else:
        check_hf_model("model_path", cfg.model_path)
        check_tokenizer("tokenizer_path" if cfg.tokenizer_path else "model_path",
                        cfg.tokenizer_path or cfg.model_path)
        server = cfg.server
        if server is not None and not server.addresses and server.model_path != cfg.model_path:
            check_hf_model("server.model_path", server.model_path)
        if cfg.ppo.kl_coef and cfg.ppo.ref_model_path:
            check_hf_model("ppo.ref_model_path", cfg.ppo.ref_model_path)
            check_same_architecture("ppo.ref_model_path", cfg.ppo.ref_model_path, "model_path", cfg.model_path)
        trainer = cfg.trainer
        if trainer is not None:
            check_writable_dir("trainer.log_dir", trainer.log_dir)
            if cfg.eval_dataset is not None and trainer.eval_freq:
                check_dataset("eval_dataset.path", cfg.eval_dataset.path)
    if cfg.dataset is not None:
        check_dataset("dataset.path", cfg.dataset.path)


def check_eval_paths(job) -> None:
    """Every path ``areal-mcore eval`` will use (an ``eval.config.EvalJob``), before any server starts."""
    server, e = job.server, job.eval
    if not server.addresses:  # running servers may hold a model this machine has no copy of
        check_hf_model("server.model_path", server.model_path)
    _check_tokenizer_of(job)
    for d in job.datasets:
        check_dataset("eval.data" if e.data else "eval_dataset.path", d.path)
    if e.out:
        check_writable_dir("eval.out", str(Path(e.out).parent))


def check_filter_paths(job, kind: str) -> None:
    """Every path ``areal-mcore filter <kind>`` will use (an ``eval.config.FilterJob``).

    Args:
        job: the resolved filter section, dataset, servers and tokenizer.
        kind: ``"difficulty"`` or ``"length"``.
    """
    data, f = job.dataset.path, job.filter
    check_dataset("dataset.path", data)
    if Path(data).suffix.lower() != ".jsonl" or not Path(data).is_file():
        # Kept rows are copied byte for byte, which only a JSONL file's lines allow.
        raise PathError(f"dataset.path={data}: the filters read and write one JSONL file; write the dataset "
                        "as JSONL first (datasets: Dataset.to_json(path, lines=True))")
    check_writable_dir("filter.out", str(Path(f.out).parent))
    if kind == "difficulty" and f.samples:  # scoring precomputed samples: no model
        check_readable_file("filter.samples", f.samples, "a JSONL file of completions")
        return
    if kind == "difficulty" and not job.server.addresses:
        if not job.server.model_path:
            raise PathError("filter difficulty needs samples or a model to draw them from: give --model "
                            "HF_FOLDER, --server-url HOST:PORT with --tokenizer FOLDER, or --samples FILE "
                            "(server.model_path, server.addresses, filter.samples)")
        check_hf_model("server.model_path", job.server.model_path)
    _check_tokenizer_of(job)


def _check_tokenizer_of(job) -> None:
    # The job's tokenizer is tokenizer_path, else the served model's folder (eval/config.py).
    from_model = job.tokenizer_path is not None and job.tokenizer_path == job.server.model_path
    check_tokenizer("server.model_path" if from_model else "tokenizer_path", job.tokenizer_path)


def is_hub_id(value: str) -> bool:
    """``owner/name`` (one slash, no leading ``/`` or ``.``): what the hub accepts as a repo id."""
    parts = value.split("/")
    return (len(parts) == 2 and all(parts) and not value.startswith((".", "~"))
            and all(c.isalnum() or c in "-_." for c in value.replace("/", "")))


def data_files(folder: Path) -> list[Path]:
    """The data files of a dataset folder (recursively, sorted), or a ``save_to_disk``
    folder's Arrow files; empty when it holds neither."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in DATA_SUFFIXES
                   and p.name not in ("dataset_info.json", "state.json", "dataset_dict.json"))
    if not files:
        files = sorted(folder.rglob("*.arrow"))
    return files


def _given(key: str, value: str | None, expected: str) -> Path:
    if value is None or not str(value).strip():
        raise PathError(f"{key} is not set; expected {expected}")
    return Path(os.path.expanduser(str(value)))


def _missing_or_kind(path: Path) -> str:
    if not path.exists():
        return "no such file or folder"
    return "a folder, not a file" if path.is_dir() else "a file, not a folder"


def _try_read(key: str, value: str, path: Path, expected: str) -> None:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise PathError(f"{key}={value}: cannot read {path} ({e.strerror}); expected {expected}") from None
