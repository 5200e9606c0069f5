"""MegatronActor: a megatron-core GPTModel with DDP + DistributedOptimizer that computes
token logprobs and trains on THD micro-batches with a caller-supplied loss.

The loss contract (``LossFn``): ``loss_fn(logprobs_T, micro_batch, num_global_tokens,
num_global_seqs)`` (and ``entropy_T=`` θ's entropies when ``train_batch(entropy=True)``)
returns ``(loss, stats)`` where ``loss`` is already a *sum* over the
micro-batch divided by a count of the whole minibatch on all data-parallel ranks: its
loss tokens, or (per-sequence aggregations) its sequences with at least one loss token.
The actor undoes megatron's own averaging so that these losses add up to the exact mean.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from functools import partial
from itertools import accumulate

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func

from areal_mcore import accel, collectives
from areal_mcore.actor import router_replay
from areal_mcore.actor.config import ActorConfig
from areal_mcore.actor.logprobs import token_aligned, token_logprobs_entropy
from areal_mcore.actor.parallel import ParallelGroups, init_parallel
from areal_mcore.devices import check_bound
from areal_mcore.kernels.logprob import logprob_entropy
from areal_mcore.model import adapter
from areal_mcore.model.args import (
    ModelArgs,
    check_expert_parallel,
    check_router_replay,
    padded_vocab_size,
    stage_layer_counts,
    stage_layer_range,
)
from areal_mcore.model.hf_config import build_gpt_model, transformer_config
from areal_mcore.packing import (
    PackedBatch,
    allocate_micro_batches,
    allocate_micro_batches_synced,
    pack,
    unpack,
)
from areal_mcore.packing.cp import cp_gather, cp_token_index, cp_view, predicts_nothing, shift_left
from areal_mcore.packing.thd import to_device

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LossFn = Callable[[torch.Tensor, PackedBatch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict]]


class MegatronActor:
    """Owns the model, optimizer and LR schedule of one rank; parallelism comes from cfg."""

    def __init__(self, cfg: ActorConfig, hf_config, *, seed: int = 1, total_optimizer_steps: int = 1):
        self.cfg = cfg
        self.hf_config = hf_config
        p = cfg.parallel
        self.args = ModelArgs.from_hf(hf_config)
        if p.first_stage_layers is not None or p.last_stage_layers is not None:
            self.args = dataclasses.replace(self.args, pipeline_split=tuple(stage_layer_counts(
                self.args.num_layers, p.pp, p.first_stage_layers, p.last_stage_layers)))
        check_expert_parallel(self.args, p.ep)  # before megatron builds groups for it
        check_router_replay(self.args, cfg.router_replay)
        self.groups: ParallelGroups = init_parallel(cfg.parallel, seed)
        g = self.groups
        found = accel.detect()
        if dist.get_rank() == 0 and (line := accel.fallbacks(found)):
            print(line, flush=True)
        check_bound()  # megatron allocates on torch.cuda.current_device(): it must be LOCAL_RANK's
        self.device = torch.device("cuda", torch.cuda.current_device()) if found.cuda else torch.device("cpu")
        self.padded_vocab = padded_vocab_size(self.args.vocab_size, g.tp_size, cfg.vocab_divisible_by)
        dtype = DTYPES[cfg.dtype]
        self._found = found
        self.config, model = self._build_module()
        self.model = DistributedDataParallel(
            config=self.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=cfg.overlap_grad_reduce,
                overlap_param_gather=cfg.overlap_param_gather, use_distributed_optimizer=True,
            ),
            module=model,
        )
        o = cfg.optimizer
        self.optimizer = get_megatron_optimizer(
            MegatronOptimizerConfig(
                optimizer="adam", lr=o.lr, min_lr=o.lr * o.min_lr_ratio, weight_decay=o.weight_decay,
                adam_beta1=o.beta1, adam_beta2=o.beta2, adam_eps=o.eps, clip_grad=o.gradient_clipping,
                use_distributed_optimizer=True, bf16=dtype == torch.bfloat16, params_dtype=dtype,
            ),
            [self.model],
        )
        warmup = int(o.warmup_steps_proportion * total_optimizer_steps)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if warmup else o.lr, max_lr=o.lr, min_lr=o.lr * o.min_lr_ratio,
            lr_warmup_steps=warmup, lr_decay_steps=max(total_optimizer_steps, warmup + 1),
            lr_decay_style=o.lr_scheduler, start_wd=o.weight_decay, end_wd=o.weight_decay,
            wd_incr_steps=1, wd_incr_style="constant",
        )
        # The schedules all-reduce grads and embedding ties through this hook.
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = self.model.no_sync
        self.config.grad_scale_func = self.optimizer.scale_loss
        self._fb = get_forward_backward_func()
        # This stage's MoE layers (global indices): its routers, in order, read those
        # columns of the routed_experts field [T, num_layers, K].
        held = stage_layer_range(self.args.num_layers, g.pp_size, g.pp_rank, p.first_stage_layers, p.last_stage_layers)
        self._stage_moe_layers = [i for i in held if self.args.is_moe_layer(i)]
        self._routers_of: dict[int, list] = {}
        self._router_counts: torch.Tensor | None = None  # [differing, compared] while measured
        # The fraction of (token, MoE layer) entries whose top-k set differs from the
        # rollout's, from the last compute_logprobs of the actor's model on a batch with
        # routed_experts (None otherwise).
        self.router_disagreement: float | None = None

    def _build_module(self):
        """(TransformerConfig, GPTModel) of this rank's shard, on the device; each call a
        new config object, since the actor's gets the training hooks below."""
        cfg, p, g, found = self.cfg, self.cfg.parallel, self.groups, self._found
        dtype = DTYPES[cfg.dtype]
        use_te = {"auto": found.transformer_engine, "local": False, "te": True}[cfg.layer_spec]
        if use_te and not found.transformer_engine:
            raise ValueError("actor.layer_spec=te needs TransformerEngine with CUDA; use auto or local")
        config = transformer_config(self.args, tp_size=g.tp_size, pp_size=g.pp_size,
                                    params_dtype=dtype, recompute=cfg.recompute,
                                    recompute_granularity=cfg.recompute_granularity,
                                    sequence_parallel=p.use_sequence_parallel,
                                    first_stage_layers=p.first_stage_layers,
                                    last_stage_layers=p.last_stage_layers,
                                    on_gpu=found.cuda, fused=use_te, ep_size=g.ep_size,
                                    moe_grouped_gemm=use_te, cp_size=g.cp_size, cp_comm_type=p.cp_comm_type,
                                    gradient_accumulation_fusion=accel.wgrad_fusion(
                                        cfg.gradient_accumulation_fusion, found))
        model = build_gpt_model(self.args, config, padded_vocab=self.padded_vocab,
                                use_te=use_te, pre_process=g.is_first_stage,
                                post_process=g.is_last_stage, pp_rank=g.pp_rank,
                                pg_collection=g.collection)
        return config, model.to(self.device)

    def build_frozen_model(self, state_dict: dict[str, torch.Tensor]) -> torch.nn.Module:
        """A second GPTModel sharded exactly like this actor's (same parallel groups and
        layer spec), loaded with full HF tensors of the same architecture, parameters only:
        no DDP buffers, no optimizer state, no gradients (the KL's reference model,
        ``ppo.kl_coef``). ``compute_logprobs(model=)`` runs it through the same schedule.
        Its TransformerConfig has none of the actor's hooks (DDP's no_sync, grad
        finalisation): megatron's schedules read them from the model's config
        (``get_model_config`` in pipeline_parallel/schedules.py)."""
        _, model = self._build_module()
        model.requires_grad_(False).eval()
        g = self.groups
        adapter.copy_into(model, adapter.from_hf(state_dict, self.args, tp_rank=g.tp_rank, tp_size=g.tp_size,
                                                 pp_rank=g.pp_rank, pp_size=g.pp_size,
                                                 padded_vocab=self.padded_vocab,
                                                 ep_rank=g.ep_rank, ep_size=g.ep_size))
        return model

    # ------------------------------------------------------------------ weights

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Loads full HF tensors (this rank takes its TP/PP shard and its EP rank's experts)."""
        g = self.groups
        local = adapter.from_hf(state_dict, self.args, tp_rank=g.tp_rank, tp_size=g.tp_size,
                                pp_rank=g.pp_rank, pp_size=g.pp_size, padded_vocab=self.padded_vocab,
                                ep_rank=g.ep_rank, ep_size=g.ep_size)
        adapter.copy_into(self.model.module, local)
        self.optimizer.reload_model_params()

    def hf_state_dict(self, writer_only: bool = False) -> dict[str, torch.Tensor]:
        """This pipeline stage's weights in HF names and layout, gathered over TP, and its
        experts over the expert-parallel group (every expert, on every rank).

        ``writer_only``: only the stage's TP-rank 0 of data-parallel replica 0 (with EP, of
        expert-data-parallel rank 0, whose EP rank 0 is DP rank 0) gets them, the others {}:
        the exporter's way (save_hf), where an all-gather had every rank hold the whole stage
        on the host (61 GB per rank of Qwen3-30B-A3B at PP=1). The other replicas take no
        part: each TP and EP group lies within one expert-data-parallel rank."""
        g = self.groups
        if writer_only and g.expert_dp_rank != 0:
            return {}
        local = {n: p.detach() for n, p in adapter.module_weights(self.model.module).items()}
        shards = [dict() for _ in range(g.tp_size)]
        for name in sorted(local):
            for r, part in enumerate(_gathered(local[name], g.tp, writer_only)):
                shards[r][name] = part.cpu()
        if writer_only and g.tp_rank != 0:
            return {}
        out = adapter.to_hf(shards, self.args, pp_rank=g.pp_rank, pp_size=g.pp_size,
                            ep_rank=g.ep_rank, ep_size=g.ep_size)
        if g.ep_size > 1:
            out.update(self._other_experts(shards, writer_only))
        return {} if writer_only and g.ep_rank != 0 else out

    def _other_experts(self, shards: list[dict[str, torch.Tensor]], writer_only: bool) -> dict[str, torch.Tensor]:
        """The HF tensors of the other EP ranks' experts. Every EP rank has the same local
        names and shapes (``num_experts / ep`` experts each), so one all-gather (a gather to EP
        rank 0, ``writer_only``) per local expert weight brings rank r's copy of it, which is
        global expert ``r * n + local``; ``shards`` (already gathered over expert-TP = TP) are
        gathered, TP slice by slice."""
        g = self.groups
        names = [name for p, name, _ in adapter.stage_entries(self.args, g.pp_rank, g.pp_size, tied_copy=False,
                                                              ep_rank=g.ep_rank, ep_size=g.ep_size)
                 if p.per_expert]
        by_ep = [[dict() for _ in range(g.tp_size)] for _ in range(g.ep_size)]
        for name in names:
            for t in range(g.tp_size):
                for r, part in enumerate(_gathered(shards[t][name], g.ep, writer_only)):
                    by_ep[r][t][name] = part
        if writer_only and g.ep_rank != 0:
            return {}
        out = {}
        for r in range(g.ep_size):
            if r != g.ep_rank:
                out.update(adapter.to_hf(by_ep[r], self.args, pp_rank=g.pp_rank, pp_size=g.pp_size,
                                         only=set(names), ep_rank=r, ep_size=g.ep_size))
        return out

    # ------------------------------------------------------------------ checkpoint state

    def sharded_state_dict(self, for_loading: bool = False, weights_only: bool = False) -> dict:
        """Model + optimizer state for ``megatron.core.dist_checkpointing`` (DP-reshardable);
        ``weights_only``: the model's alone, the optimizer left untouched."""
        model = self.model.module.sharded_state_dict()
        if weights_only:
            return {"model": model}
        self._fill_empty_optimizer_state()
        optimizer = self.optimizer.sharded_state_dict(
            model, is_loading=for_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
        )
        return {"model": model, "optimizer": optimizer}

    @torch.no_grad()
    def load_sharded_state(self, state: dict, weights_only: bool = False) -> None:
        """Loads what ``dist_checkpointing.load(self.sharded_state_dict(True), dir)`` returned;
        ``weights_only``: the model's part alone, the optimizer as built."""
        self.model.module.load_state_dict(state["model"])
        if weights_only:
            self.optimizer.reload_model_params()  # the fp32 main copies follow the new weights
            return
        self.optimizer.load_state_dict(state["optimizer"])
        # The distributed optimizer restores one shared step per param group, but torch's
        # Adam (the fallback without apex/TE) counts steps per parameter: copy it back.
        for opt in self._torch_optimizers():
            for group in opt.param_groups:
                if "step" in group:
                    for p in group["params"]:
                        opt.state[p]["step"] = torch.tensor(float(group["step"]))

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """The inner torch Adam(W) optimizers (the fallback when apex/TE are absent)."""
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return [o.optimizer for o in chained if isinstance(o.optimizer, torch.optim.Adam | torch.optim.AdamW)]

    def _fill_empty_optimizer_state(self) -> None:
        # DistributedOptimizer.state_dict() (without apex/TE) asserts that torch Adam's
        # per-parameter states share one 'step'; an optimizer that has not stepped yet has
        # no state at all. Zero moments at step 0 are exactly what Adam would create, so
        # they are filled in before saving (e.g. right after an HF import) and before
        # building a load template (the load overwrites them).
        for opt in self._torch_optimizers():
            for group in opt.param_groups:
                for p in group["params"]:
                    if not opt.state.get(p):
                        opt.state[p] = {"step": torch.zeros(()), "exp_avg": torch.zeros_like(p),
                                        "exp_avg_sq": torch.zeros_like(p)}

    # ------------------------------------------------------------------ forward

    def _forward_step(self, loss_func, data_iterator: Iterator[PackedBatch], model):
        # No host sync here (on a GPU the batch is built on the device, trainer/batch.py):
        # what the host needs, the lengths, the packer kept on the host. Without padding
        # the four cu_seqlens are one tensor: TE 2.4-2.10 compares the padded ones with
        # the true ones in every layer, on the host unless they alias
        # (transformer_engine/pytorch/attention/dot_product_attention/
        # dot_product_attention.py::DotProductAttention.forward, pad_between_seqs).
        # The whole micro-batch moves: the loss multiplies the logprobs (on the device) by
        # its fields (loss mask, advantages).
        mb = next(data_iterator).to(self.device)
        cu_padded = mb.cu_seqlens_padded if mb.padded else mb.cu_seqlens
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=mb.cu_seqlens, cu_seqlens_kv=mb.cu_seqlens,
            cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
            max_seqlen_q=mb.max_seqlen, max_seqlen_kv=mb.max_seqlen,
        )
        experts = None
        if router_replay.FIELD in mb.fields:  # without it the routers are idle (_run stops them)
            routers, experts = self._stage_routing(model, mb)
            # megatron checkpoints whole layers only in training (TransformerBlock.forward)
            recompute = model.training and self.config.recompute_granularity == "full"
            router_replay.start(routers, experts, self.cfg.router_replay, recompute)
        # Under CP this rank's tokens only, with the whole row's cu_seqlens in ``params``
        # (packing/cp.py says why); the position ids are unused by RoPE, which megatron
        # derives from the cu_seqlens per CP rank (rope_utils.py, _apply_rotary_pos_emb_thd).
        ids_T, pos_T = mb.input_ids, mb.position_ids
        if self.groups.cp_size > 1:
            local = self._cp_index(mb)
            ids_T, pos_T = ids_T[local], pos_T[local]
        output = model(ids_T.unsqueeze(0), pos_T.unsqueeze(0), attention_mask=None,
                       packed_seq_params=params)
        if experts is not None and self._router_counts is not None:
            real_T = torch.zeros(mb.input_ids.numel(), dtype=torch.bool)
            for start, n in zip(accumulate(mb.seqlens_padded[:-1], initial=0), mb.seqlens, strict=True):
                real_T[start:start + n] = True
            real = self._local_tokens(to_device(real_T, self.device), mb)
            self._router_counts += router_replay.disagreement_counts(routers, experts, real)
        return output, partial(loss_func, mb)

    def _cp_index(self, mb: PackedBatch) -> torch.Tensor:
        """Positions in ``mb``'s packed row of this CP rank's tokens, on the device."""
        g = self.groups
        return cp_token_index(mb.seqlens_padded, g.cp_size, g.cp_rank, self.device)

    def _local_tokens(self, x_T: torch.Tensor, mb: PackedBatch) -> torch.Tensor:
        """The rows of a per-token tensor of ``mb`` that this rank's layers see: its CP
        chunks, then its TP slice of them under sequence parallelism."""
        g = self.groups
        if g.cp_size > 1:
            x_T = x_T[cp_token_index(mb.seqlens_padded, g.cp_size, g.cp_rank, x_T.device)]
        return router_replay.local_tokens(x_T, self.groups.tp_rank, self.groups.tp_size,
                                          self.config.sequence_parallel)

    def _stage_routing(self, model, mb: PackedBatch) -> tuple[list, torch.Tensor | None]:
        """This stage's routers in ``model`` and the rollout's experts for them: the
        micro-batch's routed_experts [T, num_layers, K] cut to this stage's MoE layers and
        to the tokens this rank's routers see (None without the field or routers)."""
        if id(model) not in self._routers_of:
            self._routers_of[id(model)] = router_replay.stage_routers(model)
        routers = self._routers_of[id(model)]
        experts = mb.fields.get(router_replay.FIELD)
        if not routers or experts is None:
            return routers, None
        shape, want = tuple(experts.shape), (self.args.num_layers, self.args.moe_top_k)
        if len(shape) == 2 and shape[1] == want[0] * want[1]:  # the rollout's [T, W] (trainer/dispatch.py)
            experts, shape = experts.view(-1, *want), (shape[0], *want)
        if len(shape) != 3 or shape[1:] != want:
            raise ValueError(f"the batch's {router_replay.FIELD} field has shape {shape}; expected [tokens, "
                             f"{want[0]} layers, {want[1]} experts] (the engines' format)")
        assert len(routers) == len(self._stage_moe_layers), "one router per MoE layer of the stage"
        return routers, self._local_tokens(experts[:, self._stage_moe_layers], mb)

    def _logprobs(self, mb: PackedBatch, logits_1TV: torch.Tensor,
                  temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(logp_T, entropy_T) of ``mb``, the micro-batch ``_forward_step`` moved to the
        device. The fused kernel computes both in one pass; an entropy the loss leaves
        unused costs no backward work (``kernels.logprob``).

        Without CP they align with ``mb``'s own tokens. Under CP the logits are this
        rank's tokens only, and a chunk's last position predicts another chunk's first
        token: so the targets are taken from the whole row, and the results align with
        ``_loss_view(mb)`` (this rank's share at the predicting positions)."""
        g = self.groups
        if g.cp_size > 1:
            targets = shift_left(mb.input_ids, mb.seqlens_padded)[self._cp_index(mb)]
            logp, ent = logprob_entropy(logits_1TV.squeeze(0), targets, vocab_size=self.args.vocab_size,
                                        tp_rank=g.tp_rank, tp_group=g.tp, temperature=temperature,
                                        kernel=self.cfg.logprob_kernel)
            # A segment's last position scores its first token (shift_left's wrap-around): 0,
            # as a sequence's first token gets without CP (token_aligned).
            nothing = predicts_nothing(mb.seqlens_padded, g.cp_size, g.cp_rank, logp.device)
            return logp.masked_fill(nothing, 0.0), ent.masked_fill(nothing, 0.0)
        return token_logprobs_entropy(logits_1TV.squeeze(0), mb.input_ids, mb.cu_seqlens_padded,
                                      vocab_size=self.args.vocab_size, tp_rank=g.tp_rank, tp_group=g.tp,
                                      temperature=temperature, kernel=self.cfg.logprob_kernel)

    def _loss_view(self, mb: PackedBatch) -> PackedBatch:
        """What the loss reads beside ``_logprobs``: ``mb`` itself, or under CP this rank's
        share of it at the predicting positions (``packing.cp.cp_view``)."""
        g = self.groups
        return cp_view(mb, g.cp_size, g.cp_rank, g.cp) if g.cp_size > 1 else mb

    def _aligned(self, batch: PackedBatch) -> PackedBatch:
        """``batch`` with every sequence padded to a multiple of TP under sequence parallelism:
        megatron scatters the packed row over the TP ranks along the tokens and asserts that
        they divide evenly (tensor_parallel/mappings.py, ``_reduce_scatter_along_first_dim``);
        and of 2·cp under context parallelism (each sequence in 2·cp equal chunks,
        packing/cp.py), 2·cp·tp with both. Padding sits at the end of each segment, so causal
        attention keeps the real tokens' numbers, and the padded positions carry zero fields
        (masked out of the loss)."""
        g = self.groups
        m = (g.tp_size if self.config.sequence_parallel else 1) * (2 * g.cp_size if g.cp_size > 1 else 1)
        if batch.pad_to_multiple_of % m == 0:
            return batch
        seqs, fields = unpack(batch)
        return pack(seqs, fields, pad_to_multiple_of=math.lcm(batch.pad_to_multiple_of, m))

    def _mb_budget(self) -> int:
        """Tokens of the whole row per micro-batch: ``max_tokens_per_mb`` is what one rank
        holds, and a CP rank holds 1/cp of each sequence."""
        return self.cfg.mb_spec.max_tokens_per_mb * self.groups.cp_size

    def _run(self, micro_batches: list[PackedBatch], loss_func, forward_only: bool,
             model: torch.nn.Module | None = None):
        module = self.model if model is None else model
        try:
            return self._fb(
                forward_step_func=partial(self._forward_step, loss_func),
                data_iterator=iter(micro_batches),
                model=[module],
                num_microbatches=len(micro_batches),
                seq_length=max(int(mb.input_ids.numel()) for mb in micro_batches),
                micro_batch_size=1,
                forward_only=forward_only,
            )
        finally:  # no replay target outlives the batch it came with
            router_replay.stop(self._routers_of.get(id(module), []))

    @torch.no_grad()
    def compute_logprobs(self, batch: PackedBatch, temperature: float = 1.0,
                         model: torch.nn.Module | None = None,
                         stop: Callable[[], bool] | None = None) -> torch.Tensor | None:
        """logp_T of ``batch``'s own tokens (0 at sequence starts), on every rank, by the
        actor's model or ``model`` (one from ``build_frozen_model``).

        ``stop``: asked between micro-batches where this rank shares no collective in the
        forward (TP, PP and EP 1; elsewhere the ranks would leave at different micro-batches
        and the others wait in one): None once it says so (a signal: the caller agrees
        with the other ranks to abandon the step)."""
        g = self.groups
        module = self.model if model is None else model
        module.eval()
        aligned = self._aligned(batch)
        lens = aligned.seqlens_padded
        bins = allocate_micro_batches(lens, self._mb_budget(),
                                      min_mbs=min(g.pp_size, len(lens)))
        micro = aligned.select_many(bins)

        def loss_func(mb, logits):
            logp, _ = self._logprobs(mb, logits, temperature)
            if g.cp_size > 1:  # this rank's predicting positions -> the whole row's tokens
                logp = token_aligned(cp_gather(logp, mb.seqlens_padded, g.cp_size, g.cp), mb.cu_seqlens_padded)
            return logp.sum() * 0.0, {"logprobs": logp}

        measure = model is None and router_replay.FIELD in batch.fields
        # float64: counts stay exact past float32's 2^24 (tokens x MoE layers of a step)
        self._router_counts = torch.zeros(2, dtype=torch.float64, device=self.device) if measure else None
        if stop is not None and g.tp_size == g.pp_size == g.ep_size == g.cp_size == 1:
            outputs = []
            for mb in micro:
                if stop():
                    if model is None:
                        self.model.train()
                    return None
                outputs += self._run([mb], loss_func, forward_only=True, model=module)
        else:
            outputs = self._run(micro, loss_func, forward_only=True, model=module)
        if model is None:
            self.router_disagreement = self._reduce_router_counts() if measure else None
        out_T = torch.zeros(batch.input_ids.numel(), dtype=torch.float32, device=self.device)
        if g.is_last_stage:
            starts = list(accumulate(batch.seqlens_padded, initial=0))
            for b, mb, out in zip(bins, micro, outputs, strict=True):
                for i, logp in zip(b, mb.split(out["logprobs"]), strict=True):
                    out_T[starts[i] : starts[i] + logp.numel()] = logp
        if g.pp_size > 1:
            collectives.broadcast(out_T, g.pp_last_rank, g.pp)
        if model is None:
            self.model.train()
        return out_T

    def _reduce_router_counts(self) -> float | None:
        """The disagreement over every rank: DP ranks hold other sequences, PP stages other
        layers, CP ranks and TP ranks under sequence parallelism other tokens (without SP
        TP ranks count the same entries, which scales both sums alike)."""
        c, g = self._router_counts, self.groups
        self._router_counts = None
        for group in (g.dp, g.cp, g.tp, g.pp):
            collectives.all_reduce(c, group)
        differing, compared = c.tolist()
        return differing / compared if compared > 0 else None

    # ------------------------------------------------------------------ train

    def train_batch(self, batch: PackedBatch, loss_fn: LossFn, n_minibatches: int = 1,
                    reduce_stats: Callable[[list[dict], dist.ProcessGroup], dict] | None = None,
                    *, temperature: float = 1.0, step: int | None = None, entropy: bool = False) -> dict:
        """One optimizer step per minibatch (contiguous slices of the sequences).

        ``temperature`` divides the logits before the logprobs (PPO: the rollout's, so
        θ and the proximal policy score the distribution the tokens were sampled from;
        SFT: 1). ``entropy``: ``loss_fn`` also gets ``entropy_T=`` (θ's next-token
        entropies, differentiable, aligned like the logprobs). A minibatch with no sequence on this rank (fewer sequences than
        minibatches) runs one-token placeholders with no loss tokens, so the rank still
        takes part in every collective. A non-finite loss raises ``FloatingPointError``
        naming ``step`` and the minibatch on every rank, before the optimizer steps.

        Returns per-minibatch ``loss`` (the exact token mean over all DP ranks),
        ``grad_norm``, ``n_micro_batches``, plus ``tokens``, ``lr``, ``time_s``, the loss
        function's per-micro-batch ``micro_stats`` (last pipeline stage only) and, with
        ``reduce_stats`` (e.g. ``algo.reduce_ppo_stats``), ``stats`` reduced over the DP
        group on the last stage (clip ratio, KL, ...).
        """
        if "loss_mask" not in batch.fields:
            raise ValueError("train_batch needs a 'loss_mask' field in the packed batch "
                             "(1 on the tokens the loss counts, e.g. the response)")
        g = self.groups
        t0 = time.perf_counter()
        self.model.train()
        result = {"loss": [], "grad_norm": [], "n_micro_batches": [], "micro_stats": []}
        minibatches = _minibatches(batch, n_minibatches)
        for k, sub in enumerate(minibatches):
            micro, counts = self._plan_minibatch(sub, batch)
            loss, outputs = self._forward_backward(micro, loss_fn, counts, temperature, entropy)
            if g.is_last_stage:
                result["micro_stats"].extend(outputs)
            _check_finite(loss, outputs, f"{f'step {step}, ' if step is not None else ''}"
                                         f"minibatch {k + 1}/{len(minibatches)}")
            grad_norm = self._optimizer_step(last=k == len(minibatches) - 1)
            result["loss"].append(float(loss))
            result["grad_norm"].append(float(grad_norm) if grad_norm is not None else float("nan"))
            result["n_micro_batches"].append(len(micro))
        if reduce_stats is not None and g.is_last_stage:
            result["stats"] = reduce_stats(result["micro_stats"], g.dp_cp)  # CP ranks hold other tokens
        result["tokens"] = int(batch.input_ids.numel())
        result["lr"] = self.optimizer.param_groups[0]["lr"]  # after this step's scheduler updates
        result["time_s"] = time.perf_counter() - t0
        return result

    def _plan_minibatch(self, sub: PackedBatch | None,
                        batch: PackedBatch) -> tuple[list[PackedBatch], tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of one minibatch (a placeholder where it has none of
        its sequences), and the minibatch's counts over the DP group: loss tokens, and
        sequences with at least one loss token (the per-sequence losses' normaliser)."""
        g = self.groups
        # One all-reduce gives the global loss-token and loss-sequence counts and the
        # minibatch's sequence count, which bounds the micro-batch count any rank can ask for.
        counts = torch.tensor([0.0 if sub is None else float(sub.fields["loss_mask"].sum()),
                               0.0 if sub is None else float(sub.num_seqs),
                               0.0 if sub is None else float(_loss_seqs(sub))], device=self.device)
        collectives.all_reduce(counts, g.dp)
        # a minibatch without loss tokens: 0, not 0/0
        totals = (counts[0].clamp(min=1.0), counts[2].clamp(min=1.0))
        if sub is None:
            sub = _placeholder(batch, max(int(counts[1]), 1))
        sub = self._aligned(sub)
        lens = sub.seqlens_padded
        bins = allocate_micro_batches_synced(lens, self._mb_budget(), group=g.dp,
                                             min_mbs=min(g.pp_size, len(lens)))
        return sub.select_many(bins), totals

    def _forward_backward(self, micro: list[PackedBatch], loss_fn: LossFn,
                          counts: tuple[torch.Tensor, torch.Tensor],
                          temperature: float, entropy: bool) -> tuple[torch.Tensor, list[dict]]:
        """Gradients of one minibatch; returns its loss (summed over micro-batches, DP and CP,
        on every rank) and the loss function's per-micro-batch stats (last stage)."""
        g, n_mb = self.groups, len(micro)

        def loss_func(mb, logits):
            logp, ent = self._logprobs(mb, logits, temperature=temperature)
            mb = self._loss_view(mb)
            loss, stats = loss_fn(logp, mb, *counts, **({"entropy_T": ent} if entropy else {}))
            stats = {**stats, "loss": loss.detach().clone()}
            # megatron divides each micro-batch loss by num_microbatches and multiplies it by
            # the CP size (schedules.py, forward_step: the 2-tuple loss_func branch), and DDP
            # averages grads over DP x CP (gradient_scaling_factor = 1 / dp_cp_group.size(),
            # distributed_data_parallel.py); our loss is already normalised by a global
            # count, each CP rank's over its own tokens, so all three are undone here to
            # keep the sum over DP x CP an exact mean (the CP factors cancel).
            return loss * n_mb * g.dp_size, stats

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run(micro, loss_func, forward_only=False)
        loss = torch.zeros((), device=self.device)
        if g.is_last_stage:
            loss = sum(o["loss"] for o in outputs).float()
        collectives.all_reduce(loss, g.dp_cp)
        if g.pp_size > 1:
            collectives.broadcast(loss, g.pp_last_rank, g.pp)
        return loss, outputs

    def _optimizer_step(self, *, last: bool):
        """The optimizer and LR scheduler step; returns the grad norm (None if unknown)."""
        _, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        if self.cfg.overlap_param_gather and last:
            # With overlap_param_gather the optimizer step leaves the updated shards
            # un-gathered until the next forward's pre-hooks
            # (DistributedDataParallel.start_param_sync); weights leave this actor
            # (sync, export, checkpoint) after train_batch, so gather them now.
            self.model.start_param_sync(force_sync=True)
        return grad_norm


def _minibatches(batch: PackedBatch, n: int) -> list[PackedBatch | None]:
    """``n`` contiguous slices of the sequences; None where a slice is empty (fewer
    sequences than minibatches on this rank)."""
    splits = [ids.tolist() for ids in np.array_split(np.arange(batch.num_seqs), n)]
    chosen = batch.select_many([ids for ids in splits if ids])
    return [chosen.pop(0) if ids else None for ids in splits]


def _loss_seqs(batch: PackedBatch) -> torch.Tensor:
    """Sequences of ``batch`` with at least one loss token (an empty response has none)."""
    csum = torch.cumsum(batch.fields["loss_mask"].long(), 0)
    csum = torch.cat([csum.new_zeros(1), csum])
    cu = batch.cu_seqlens_padded.long()
    return (csum[cu[1:]] > csum[cu[:-1]]).sum()


def _check_finite(loss: torch.Tensor, outputs: list[dict], where: str) -> None:
    """A NaN/inf in any micro-batch reaches every rank through the sum, the DP all-reduce
    and the PP broadcast, so all ranks raise together, before the optimizer step writes
    NaN into the weights."""
    if not math.isfinite(float(loss)):
        bad = [i for i, o in enumerate(outputs) if not torch.isfinite(o["loss"])]
        raise FloatingPointError(
            f"non-finite loss ({float(loss)}) at {where}"
            + (f", micro-batches {bad} of {len(outputs)} on this rank" if bad else "")
            + "; the optimizer did not step")


def _placeholder(batch: PackedBatch, n: int) -> PackedBatch:
    """``n`` one-token sequences with every field 0 (no loss tokens): what a rank trains
    on when a minibatch has none of its sequences. ``n`` is the minibatch's sequence count
    over the DP group, so any micro-batch count another rank needs can be matched."""
    one = torch.zeros(1, dtype=batch.input_ids.dtype)
    fields = {k: [torch.zeros(1, *v.shape[1:], dtype=v.dtype)] * n for k, v in batch.fields.items()}
    return pack([one] * n, fields, pad_to_multiple_of=batch.pad_to_multiple_of)


def _gathered(tensor: torch.Tensor, group, writer_only: bool) -> list[torch.Tensor]:
    """Every rank's ``tensor`` of ``group``: on every rank, or (``writer_only``) on its rank
    0 alone, the others getting none."""
    if not writer_only:
        return collectives.all_gather(tensor, group)
    return collectives.gather(tensor, dist.get_global_rank(group, 0), group) or []
