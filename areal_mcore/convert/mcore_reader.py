"""Reads the model weights of a training checkpoint one layer at a time, in HF names.

``dist_checkpointing`` stores every weight as one global tensor (TP shards placed at
their offsets, transformer layers, or an MoE layer's experts, stacked along a leading
axis), so what is read here
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

_LAYER_INDEX = re.compile(r"^decoder\.layers\.\d+\.")
_EXPERT = re.compile(r"(decoder\.layers\.\d+\.mlp\.)experts\.local_experts\.(\d+)\.(.*)")
# Optimizer state, not weights. With expert parallelism megatron chains two optimizers (dense
# and expert parameters, different data-parallel groups) and prefixes each one's keys with
# ``chained_{i}.`` (optimizer/optimizer.py, ChainedOptimizer.sharded_state_dict).
_OPTIMIZER = re.compile(r"^(chained_\d+\.)?optimizer\.")


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

    def _locate(self, name: str, layer: int) -> tuple[str, tuple[int, ...], int | None]:
        """(stored key, leading offsets of ``layer``'s region in it, expert index or None)
        of a module parameter of the one-layer stage ``layer``.

        megatron saves both specs under the TE spec's names (``adapter.te_name``). A dense
        model's layers are stacked along a leading axis (index dropped from the key). An
        MoE model's moe_layer_freq is a list, which makes TransformerBlock.sharded_state_dict
        keep each layer under its own global index (``non_homogeneous_layers``, megatron-core
        0.16 and 0.19); its SequentialMLP stores the experts of a layer stacked along a
        leading axis as ``mlp.experts.experts.*`` (experts.py, SequentialMLP.sharded_state_dict).
        An MoE layer's pre-MLP norm is a module of its own in TE's spec, stored as
        ``pre_mlp_layernorm.weight`` (model/hf_config.py makes the local spec save it so too;
        before that it used the fused name): the name the checkpoint holds is taken.
        """
        fused = self._stored_key(adapter.te_name(name), layer)
        return fused if fused[0] in self.stored else self._stored_key(name, layer)

    def _stored_key(self, name: str, layer: int) -> tuple[str, tuple[int, ...], int | None]:
        expert = None
        m = _EXPERT.fullmatch(name)
        if m:
            name, expert = m[1] + "experts.experts." + m[3], int(m[2])
        if not name.startswith("decoder.layers."):
            return name, (), expert
        if self.args.num_experts:
            return _LAYER_INDEX.sub(f"decoder.layers.{layer}.", name), (), expert
        return _LAYER_INDEX.sub("decoder.layers.", name), (layer,), expert

    def read_layer(self, layer: int) -> dict[str, torch.Tensor]:
        """HF tensors of one transformer layer (plus embedding / final norm / lm head at the ends).

        Works as a pipeline of one stage per layer: stage ``layer`` of ``num_layers``.
        """
        L = self.args.num_layers
        names = [n for _, n, _ in adapter.stage_entries(self.args, layer, L, tied_copy=False)]
        buffers, offsets, where = {}, {}, {}
        for name in names:
            key, lead, expert = self._locate(name, layer)
            if key not in self.stored:
                raise adapter.WeightMismatchError(f"{self.path}: checkpoint lacks {key!r} (needed for {name}); is it "
                                                  f"from another architecture?")
            meta = self.stored[key]
            shape = (1,) * len(lead) + tuple(meta.size[len(lead):])
            if key not in buffers:  # a layer's experts share one key: read it once
                buffers[key] = torch.empty(shape, dtype=meta.properties.dtype)
                offsets[key] = lead + (0,) * (len(shape) - len(lead))
            where[name] = key, len(lead), expert
        with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(buffers, storage_reader=FileSystemReader(str(self.path / "model")),
                     planner=_RegionPlanner(offsets), no_dist=True)
        local = {}
        for name, (key, stacked, expert) in where.items():
            t = buffers[key][0] if stacked else buffers[key]
            local[name] = t if expert is None else t[expert]
        return adapter.to_hf([local], self.args, pp_rank=layer, pp_size=L)

    def check_keys(self) -> None:
        """Raises listing stored model tensors the export would not use, and missing ones."""
        L = self.args.num_layers
        needed = {self._locate(n, stage)[0] for stage in range(L)
                  for _, n, _ in adapter.stage_entries(self.args, stage, L, tied_copy=False)}
        stored = {k for k in self.stored if not _OPTIMIZER.match(k)}
        missing, extra = sorted(needed - stored), sorted(stored - needed)
        if missing or extra:
            raise adapter.WeightMismatchError(f"{self.path}: checkpoint lacks {missing[:10]} and has unexpected "
                                              f"tensors {extra[:10]}; is it from another architecture?")

    def iter_layers(self) -> Iterator[dict[str, torch.Tensor]]:
        """Every layer in order (all HF tensors of the model, one layer at a time)."""
        self.check_keys()
        for layer in range(self.args.num_layers):
            yield self.read_layer(layer)
