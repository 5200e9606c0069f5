"""Rollout samples -> the actor's packed training batch, with boba's advantages.

Legend: B sequences (prompt + response), T packed tokens.

Per sequence: reward transform ((r + bias) * scaling, clipped), reward normalisation
(boba: per group of n_samples), then GAE over the response tokens (boba: γ = λ = 1 and no
critic, so every response token gets the sequence's normalised reward), then advantage
normalisation over all response tokens of the batch on every data-parallel rank.
Logprobs follow the actor's convention: position t holds log p(token t | tokens < t),
so the response tokens are the loss tokens and prompt positions hold 0.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from areal_mcore.algo import gae_packed, normalize, transform_reward
from areal_mcore.config import PPOConfig
from areal_mcore.packing import PackedBatch, pack


def to_train_batch(samples, ppo: PPOConfig, *, dp_group: dist.ProcessGroup | None = None,
                   pad_to_multiple_of: int = 1) -> PackedBatch:
    """Packs ``samples`` (``rollout.controller.Sample``: prompt_ids, output_ids, logprobs,
    versions, reward) with fields loss_mask, behave (rollout logprobs), versions, adv and
    empty_response (1 on the first token of a sample whose response is empty).

    Groups must be contiguous (as the controller returns them) for group normalisation.
    An empty response (a server may return none on abort, or when the prompt fills the
    context) is a prompt-only sequence with no loss tokens: it trains nothing, its reward
    still counts in its group's normalisation (it is one of the group's samples), and the
    loss reports it (``empty_responses``). A rank given no samples at all gets one
    one-token placeholder sequence with no loss tokens, and still takes part in the
    normalisation's all-reduces and in training.
    """
    seqs, fields = [], {"loss_mask": [], "behave": [], "versions": [], "empty_response": []}
    if not samples:
        seqs.append(torch.zeros(1, dtype=torch.long))
        for name, dtype in (("loss_mask", torch.bool), ("behave", torch.float32), ("versions", torch.long),
                            ("empty_response", torch.float32)):
            fields[name].append(torch.zeros(1, dtype=dtype))
    for s in samples:
        n_prompt, n_out = len(s.prompt_ids), len(s.output_ids)
        seqs.append(torch.tensor(list(s.prompt_ids) + list(s.output_ids), dtype=torch.long))
        fields["loss_mask"].append(torch.cat([torch.zeros(n_prompt), torch.ones(n_out)]).bool())
        fields["behave"].append(torch.cat([torch.zeros(n_prompt), torch.tensor(s.logprobs).float()]))
        fields["versions"].append(torch.tensor([-1] * n_prompt + list(s.versions), dtype=torch.long))
        empty = torch.zeros(n_prompt + n_out)
        empty[0] = float(n_out == 0)
        fields["empty_response"].append(empty)
    batch = pack(seqs, fields, pad_to_multiple_of=pad_to_multiple_of)

    rewards_B = transform_reward(torch.tensor([float(s.reward) for s in samples]),
                                 bias=ppo.reward_bias, scaling=ppo.reward_scaling, clip=ppo.reward_clip)
    if ppo.reward_norm is not None:
        rewards_B = normalize(rewards_B, **dataclasses.asdict(ppo.reward_norm), group=dp_group)
    if not samples:
        rewards_B = torch.zeros(1)  # the placeholder's; it has no loss token to carry it
    mask_T = batch.fields["loss_mask"]
    adv_T, _ = gae_packed(rewards_B, batch.cu_seqlens_padded, gamma=ppo.discount, lam=ppo.gae_lambda,
                          loss_mask_T=mask_T, kernel=ppo.gae_kernel)
    if ppo.adv_norm is not None:
        adv_T = normalize(adv_T, **dataclasses.asdict(ppo.adv_norm), mask=mask_T, group=dp_group)
    batch.fields["adv"] = adv_T
    return batch
