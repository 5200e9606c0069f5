"""Writes an HF model folder: sharded safetensors + index, config, generation config, tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "chat_template.jinja")


class ShardedSafetensorsWriter:
    """Buffers tensors and writes a shard whenever the buffer passes ``max_shard_bytes``.

    Shards get their final ``model-0000x-of-0000y`` names in ``close()``, once y is known.
    """

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = 2 << 30, dtype: torch.dtype | None = None):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_shard_bytes
        self.dtype = dtype
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffered = 0
        self.parts: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            t = t.to(self.dtype) if self.dtype is not None else t
            self.buffer[name] = t.contiguous()
            self.buffered += t.numel() * t.element_size()
            if self.buffered >= self.max_bytes:
                self._flush()

    def _flush(self) -> None:
        if not self.buffer:
            return
        path = self.out / f".part-{len(self.parts):05d}.safetensors"
        save_file(self.buffer, str(path), metadata={"format": "pt"})
        self.parts.append((path, list(self.buffer)))
        self.total_bytes += self.buffered
        self.buffer, self.buffered = {}, 0

    def close(self) -> dict:
        self._flush()
        n = len(self.parts)
        weight_map = {}
        for i, (tmp, names) in enumerate(self.parts, 1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            tmp.rename(self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
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
