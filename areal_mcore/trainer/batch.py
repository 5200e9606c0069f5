"""Rollout samples -> the actor's packed training batch, with boba's advantages.

Legend: B sequences (prompt + response), T packed tokens.

Per sequence: DAPO's overlong penalty p(|y|) added to the raw reward r (off by default),
reward transform ((r + p + bias) * scaling, clipped), reward normalisation
(boba: per group of n_samples), then GAE over the response tokens (boba: γ = λ = 1 and no
critic, so every response token gets the sequence's normalised reward), then advantage
normalisation over all response tokens of the batch on every data-parallel rank. With
``ppo.kl_in: reward`` each response token's reward also loses ``kl_coef`` · k(prox, ref)
before GAE, which is why the loop packs first (``pack_rollout``), scores the batch with
the proximal and reference models, then adds the advantages (``add_advantages``).
Logprobs follow the actor's convention: position t holds log p(token t | tokens < t),
so the response tokens the policy generated are the loss tokens (not a multi-turn
trajectory's tool output, version -1) and prompt positions hold 0; with
``ppo.mask_truncated_samples`` a truncated sample's (finish_reason length) are not.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
import torch.distributed as dist

from areal_mcore.algo import (
    gae_packed,
    kl_reward_penalty,
    normalize,
    overlong_penalty,
    transform_reward,
)
from areal_mcore.algo.config import OverlongPenaltyConfig, PPOConfig
from areal_mcore.packing import PackedBatch, pack
from areal_mcore.trainer.dispatch import RolloutShard


def to_train_batch(samples, ppo: PPOConfig, *, dp_group: dist.ProcessGroup | None = None,
                   pad_to_multiple_of: int = 1) -> PackedBatch:
    """Packs ``samples`` (``rollout.trajectory.Sample``: prompt_ids, output_ids, logprobs,
    versions, reward) with fields loss_mask, behave (rollout logprobs), versions, adv and
    empty_response (1 on the last token of a sample whose response is empty).

    Groups must be contiguous (as the executor returns them) for group normalisation.
    An empty response (a server may return none on abort, or when the prompt fills the
    context) is a prompt-only sequence with no loss tokens: it trains nothing, its reward
    still counts in its group's normalisation (it is one of the group's samples), and the
    loss reports it (``empty_responses``). A rank given no samples at all gets one
    one-token placeholder sequence with no loss tokens, and still takes part in the
    normalisation's all-reduces and in training.
    ``samples`` may also be a ``RolloutShard`` (what ``Dispatcher`` delivers): the batch is
    then built on the shard's device (the GPU under NCCL).
    """
    batch, rewards_B = pack_rollout(samples, ppo, dp_group=dp_group, pad_to_multiple_of=pad_to_multiple_of)
    return add_advantages(batch, rewards_B, ppo, dp_group=dp_group)


def pack_rollout(samples, ppo: PPOConfig, *, dp_group: dist.ProcessGroup | None = None,
                 pad_to_multiple_of: int = 1) -> tuple[PackedBatch, torch.Tensor]:
    """``to_train_batch`` without the advantages: the packed batch (no ``adv`` field yet)
    and each sequence's shaped, normalised reward."""
    shard = samples if isinstance(samples, RolloutShard) else RolloutShard.from_samples(samples)
    seqs, fields = _per_sequence(shard)
    batch = pack(seqs, fields, pad_to_multiple_of=pad_to_multiple_of)

    rewards_B = shard.rewards
    if ppo.overlong_penalty is not None:
        pen = ppo.overlong_penalty
        rewards_B = rewards_B + overlong_penalty(shard.output_lens, max_new_tokens=pen.max_new_tokens,
                                                 buffer_len=pen.buffer_len, penalty_factor=pen.penalty_factor)
    rewards_B = transform_reward(rewards_B, bias=ppo.reward_bias, scaling=ppo.reward_scaling,
                                 clip=ppo.reward_clip)
    if ppo.reward_norm is not None:
        rewards_B = normalize(rewards_B, **dataclasses.asdict(ppo.reward_norm), group=dp_group)
    if shard.num_samples == 0:
        rewards_B = torch.zeros(1, device=shard.tokens.device)  # the placeholder's; no loss token carries it
    if ppo.mask_truncated_samples and shard.num_samples:
        batch.fields["loss_mask"] &= _per_token(batch, shard.truncated == 0)
    return batch, rewards_B


def overlong_stats(samples, pen: OverlongPenaltyConfig) -> dict[str, float]:
    """``rollout/overlong_penalty_mean`` (over the samples, in the raw reward's units) and
    ``rollout/overlong_penalised_ratio``: how much DAPO's shaping took from the batch."""
    lens_B = torch.tensor([len(s.output_ids) for s in samples], dtype=torch.float32)
    p_B = overlong_penalty(lens_B, max_new_tokens=pen.max_new_tokens, buffer_len=pen.buffer_len,
                           penalty_factor=pen.penalty_factor)
    n = max(len(samples), 1)
    return {"rollout/overlong_penalty_mean": float(p_B.sum()) / n,
            "rollout/overlong_penalised_ratio": float((p_B < 0).sum()) / n}


def add_advantages(batch: PackedBatch, rewards_B: torch.Tensor, ppo: PPOConfig, *,
                   dp_group: dist.ProcessGroup | None = None) -> PackedBatch:
    """``batch`` with field ``adv``: GAE of ``rewards_B`` (``pack_rollout``'s), minus the KL
    penalty per token with ``ppo.kl_in: reward`` (it reads fields ``prox`` and ``ref``),
    then the advantage normalisation over the DP group."""
    mask_T = batch.fields["loss_mask"]
    penalty_T = None
    if ppo.uses_reference and ppo.kl_in == "reward":  # no gradient: these are rewards
        f = batch.fields
        penalty_T = -ppo.kl_coef * kl_reward_penalty(f["prox"], f["ref"], mask_T, ppo.kl_estimator)
    adv_T, _ = gae_packed(rewards_B, batch.cu_seqlens_padded, gamma=ppo.discount, lam=ppo.gae_lambda,
                          loss_mask_T=mask_T, token_rewards_T=penalty_T, kernel=ppo.gae_kernel)
    if ppo.adv_norm is not None:
        adv_T = normalize(adv_T, **dataclasses.asdict(ppo.adv_norm), mask=mask_T, group=dp_group)
    batch.fields["adv"] = adv_T
    return batch


def _per_token(batch: PackedBatch, x_B: torch.Tensor) -> torch.Tensor:
    """A per-sequence value on each of its packed tokens (padding included)."""
    lens_B = batch.cu_seqlens_padded[1:] - batch.cu_seqlens_padded[:-1]
    return torch.repeat_interleave(x_B.to(lens_B.device), lens_B, output_size=batch.input_ids.numel())


def _per_sequence(shard: RolloutShard) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]:
    """Per-sample token ids (int64) and fields loss_mask (the response tokens the policy
    generated), behave (0 on the prompt), versions (-1 on the prompt and on the response
    tokens no policy generated: a multi-turn trajectory's tool output, ``Sample``) and
    empty_response, on the shard's device; no samples: one one-token placeholder without
    loss tokens."""
    device = shard.tokens.device
    if shard.num_samples == 0:
        zeros = {"loss_mask": torch.bool, "behave": torch.float32, "versions": torch.long,
                 "empty_response": torch.float32}
        return [torch.zeros(1, dtype=torch.long, device=device)], {
            k: [torch.zeros(1, dtype=t, device=device)] for k, t in zeros.items()}
    lens = (shard.prompt_lens + shard.output_lens).tolist()  # one host sync per step
    T = sum(lens)
    starts_B = torch.cumsum(shard.prompt_lens + shard.output_lens, 0) - (shard.prompt_lens + shard.output_lens)
    rep = dict(repeats=shard.prompt_lens + shard.output_lens, output_size=T)
    pos_T = torch.arange(T, device=device) - torch.repeat_interleave(starts_B, **rep)
    response_T = pos_T >= torch.repeat_interleave(shard.prompt_lens, **rep)
    behave_T = torch.zeros(T, dtype=torch.float32, device=device)
    behave_T[response_T] = shard.logprobs
    versions_T = torch.full((T,), -1, dtype=torch.int64, device=device)
    versions_T[response_T] = shard.versions.long()
    # Tokens no policy generated are context, as the prompt is: no loss, no advantage (GAE
    # runs over the loss tokens only), no drift.
    mask_T = response_T & (versions_T >= 0)
    empty_T = torch.zeros(T, dtype=torch.float32, device=device)
    # On each sample's last token (any token would do: under context parallelism the loss
    # reads the fields shifted within each sequence, packing/cp.py, which moves but never drops one).
    empty_T[starts_B + shard.prompt_lens + shard.output_lens - 1] = (shard.output_lens == 0).float()
    split = partial(torch.split, split_size_or_sections=lens)
    fields = {"loss_mask": list(split(mask_T)), "behave": list(split(behave_T)),
              "versions": list(split(versions_T)), "empty_response": list(split(empty_T))}
    if shard.routed.numel():  # [T, W]: the actor views it as [T, num_hidden_layers, top_k]
        fields["routed_experts"] = list(split(shard.routed.view(T, -1)))
    return list(split(shard.tokens.long())), fields
