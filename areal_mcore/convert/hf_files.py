"""Reading HF checkpoint folders (safetensors, single file or sharded with an index).

A leaf module (safetensors only): the rollout server, the trainer and the converters
all read HF folders through it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def safetensors_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        names = ["model.safetensors"]
    for name in names:
        if not (folder / name).exists():
            raise FileNotFoundError(f"{folder / name} not found (an HF folder has model.safetensors "
                                    f"or model.safetensors.index.json and its shards)")
    return [folder / n for n in names]


def hf_tensor_names(folder: str | Path) -> list[str]:
    """The tensor names of an HF folder, read from the file headers only."""
    from safetensors import safe_open

    names = []
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            names += list(f.keys())
    return names


def load_hf_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF folder (sharded or single safetensors file)."""
    from safetensors.torch import load_file

    state = {}
    for path in safetensors_files(folder):
        state.update(load_file(str(path)))
    return state
