"""Writes an HF model folder: sharded safetensors + index, config, generation config, tokenizer."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "chat_template.jinja")
# A folder holds a tokenizer if it has one of these (fast, sentencepiece, BPE vocab).
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "vocab.json")


def has_tokenizer(folder: str | Path) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_MARKERS)


_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Writes the safetensors format tensor by tensor, never copying the whole shard.

    (``safetensors.torch.save_file`` first turns every tensor into a bytes object, which
    doubles the peak memory of a shard.) Layout: u64 header size, JSON header with
    dtype/shape/data_offsets per tensor, then the raw little-endian data.
    """
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # align the data to 8 bytes, as safetensors does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for t in tensors.values():
            f.write(t.contiguous().view(torch.uint8).reshape(-1).numpy().data)


class ShardedSafetensorsWriter:
    """Buffers tensors and writes a shard whenever the buffer passes ``max_shard_bytes``.

    Shards get their final ``model-0000x-of-0000y`` names in ``close()``, once y is known.
    """

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = 2 << 30, dtype: torch.dtype | None = None,
                 prefix: str = "part"):
        self.out = Path(out_dir)
        self.prefix = prefix
        self.out.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_shard_bytes
        self.dtype = dtype
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffered = 0
        self.parts: list[tuple[str, list[str], int]] = []

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            t = t.to(self.dtype) if self.dtype is not None else t
            size = t.numel() * t.element_size()
            if self.buffered + size > self.max_bytes:  # never hold more than one shard
                self.flush()
            self.buffer[name] = t.contiguous()
            self.buffered += size

    def flush(self) -> None:
        if not self.buffer:
            return
        path = self.out / f".{self.prefix}-{len(self.parts):05d}.safetensors"
        write_safetensors(path, self.buffer)
        self.parts.append((path.name, list(self.buffer), self.buffered))
        self.buffer, self.buffered = {}, 0

    def written_parts(self) -> list[tuple[str, list[str], int]]:
        """Flushes and returns (temporary file name, tensor names, bytes) per shard."""
        self.flush()
        return self.parts

    def close(self) -> dict:
        return finalize_shards(self.out, self.written_parts())


def finalize_shards(out_dir: str | Path, parts: list[tuple[str, list[str], int]]) -> dict:
    """Gives shards their ``model-0000x-of-0000y`` names and writes the index."""
    out = Path(out_dir)
    weight_map, total = {}, 0
    for i, (tmp, names, size) in enumerate(parts, 1):
        final = f"model-{i:05d}-of-{len(parts):05d}.safetensors"
        (out / tmp).rename(out / final)
        weight_map.update(dict.fromkeys(names, final))
        total += size
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return index


def write_model_files(out_dir: str | Path, hf_config, tokenizer_dir: str | Path | None) -> None:
    """config.json, generation_config.json and the tokenizer files next to the weights."""
    from transformers import GenerationConfig

    out = Path(out_dir)
    hf_config.save_pretrained(out)
    source = Path(tokenizer_dir) if tokenizer_dir else None
    if source is not None and (source / "generation_config.json").exists():
        shutil.copy(source / "generation_config.json", out / "generation_config.json")
    else:
        GenerationConfig.from_model_config(hf_config).save_pretrained(out)
    if source is not None:
        for name in TOKENIZER_FILES:
            if (source / name).exists():
                shutil.copy(source / name, out / name)
