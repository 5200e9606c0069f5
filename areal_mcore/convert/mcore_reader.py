"""Reads the model weights of a training checkpoint one layer at a time, in HF names.

``dist_checkpointing`` stores every weight as one global tensor (TP shards placed at
their offsets, transformer layers stacked along a leading axis), so what is read here
does not depend on the TP/PP layout that saved it. Requesting one layer's region reads
only that layer's chunks, which keeps the peak memory near one layer.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from areal_mcore.model import adapter
from areal_mcore.model.args import ModelArgs
from areal_mcore.run_dir import latest_checkpoint


class _RegionPlanner(DefaultLoadPlanner):
    """Loads a region (offsets, buffer shape) of each stored tensor into the given buffer.

    torch's default planner only loads whole tensors; ``create_read_items_for_chunk_list``
    maps a region onto the stored chunks, so only the overlapping chunks are read.
    """

    def __init__(self, offsets: dict[str, tuple[int, ...]]):
        super().__init__()
        self.offsets = offsets

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, buffer in self.state_dict.items():
            region = ChunkStorageMetadata(offsets=torch.Size(self.offsets[fqn]), sizes=buffer.shape)
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [region])
        return LoadPlan(items)

    def lookup_tensor(self, index):
        return self.state_dict[index.fqn]


class McoreCheckpointReader:
    """One checkpoint folder (``step_XXXXXXXX``) of ``actor.checkpoint``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        manifest_path = self.path / "manifest.json"
        if not manifest_path.exists():
            raise FileNotFoundError(f"{manifest_path} not found: pass a checkpoint folder "
                                    f"(step_XXXXXXXX), or the run's checkpoint root with a 'latest' file")
        self.manifest = json.loads(manifest_path.read_text())
        self.args = ModelArgs(**self.manifest["model_args"])
        metadata = FileSystemReader(str(self.path / "model")).read_metadata()
        self.stored = {k: v for k, v in metadata.state_dict_metadata.items()
                       if isinstance(v, TensorStorageMetadata)}

    @classmethod
    def resolve(cls, path: str | Path) -> McoreCheckpointReader:
        """Accepts a checkpoint folder or a checkpoint root with a ``latest`` pointer."""
        return cls(latest_checkpoint(path) or path)

    @staticmethod
    def _key(name: str) -> str:
        """The stored key of a module parameter: megatron saves both specs under the TE
        spec's names (``adapter.te_name``), layers stacked along an axis (index dropped)."""
        return re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.", adapter.te_name(name))

    def read_layer(self, layer: int) -> dict[str, torch.Tensor]:
        """HF tensors of one transformer layer (plus embedding / final norm / lm head at the ends).

        Works as a pipeline of one stage per layer: stage ``layer`` of ``num_layers``.
        """
        L = self.args.num_layers
        names = [n for _, n, _ in adapter.stage_entries(self.args, layer, L, tied_copy=False)]
        buffers, offsets, keys = {}, {}, {}
        for name in names:
            key = self._key(name)
            if key not in self.stored:
                raise adapter.WeightMismatchError(f"{self.path}: checkpoint lacks {key!r} (needed for {name}); is it "
                                                  f"from another architecture?")
            meta = self.stored[key]
            per_layer = name.startswith("decoder.layers.")
            shape = (1, *meta.size[1:]) if per_layer else tuple(meta.size)
            buffers[key] = torch.empty(shape, dtype=meta.properties.dtype)
            offsets[key] = (layer,) + (0,) * (len(shape) - 1) if per_layer else (0,) * len(shape)
            keys[name] = key
        with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(buffers, storage_reader=FileSystemReader(str(self.path / "model")),
                     planner=_RegionPlanner(offsets), no_dist=True)
        local = {name: buffers[key][0] if name.startswith("decoder.layers.") else buffers[key]
                 for name, key in keys.items()}
        return adapter.to_hf([local], self.args, pp_rank=layer, pp_size=L)

    def check_keys(self) -> None:
        """Raises listing stored model tensors the export would not use, and missing ones."""
        L = self.args.num_layers
        needed = {self._key(n) for stage in range(L)
                  for _, n, _ in adapter.stage_entries(self.args, stage, L, tied_copy=False)}
        stored = {k for k in self.stored if not k.startswith("optimizer.")}
        missing, extra = sorted(needed - stored), sorted(stored - needed)
        if missing or extra:
            raise adapter.WeightMismatchError(f"{self.path}: checkpoint lacks {missing[:10]} and has unexpected "
                                              f"tensors {extra[:10]}; is it from another architecture?")

    def iter_layers(self) -> Iterator[dict[str, torch.Tensor]]:
        """Every layer in order (all HF tensors of the model, one layer at a time)."""
        self.check_keys()
        for layer in range(self.args.num_layers):
            yield self.read_layer(layer)
