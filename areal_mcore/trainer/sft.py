"""SFT on the actor: token-level NLL over the response tokens of packed
(prompt, response) pairs — boba's SFT-200 recipe, and the warm-up that teaches the tiny
CPU model the ``\\boxed{}`` format before RL.

Legend: T packed tokens.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random

import torch

from areal_mcore.packing import PackedBatch, pack


def sft_pairs(problems, tokenizer, *, response_template: str = "The answer is {solution}.",
              suffix: str | None = None) -> list[tuple[list[int], list[int]]]:
    """(prompt ids through the chat template, response ids ending in the end-of-turn token).

    A ``messages`` problem whose last turn is the assistant's (an SFT set with written
    solutions, e.g. boba's SFT-200) trains on that turn; any other problem on
    ``response_template`` filled with its first gold solution as ``{solution}`` and its
    row's other columns by name.
    """
    from areal_mcore.data.prompts import build_prompts

    questions, responses = [], []
    for p in problems:
        if not isinstance(p.prompt, str) and p.prompt[-1][0] == "assistant":
            questions.append(dataclasses.replace(p, prompt=p.prompt[:-1]))
            responses.append(p.prompt[-1][1])
        else:
            questions.append(p)
            try:  # the row's other columns may fill it too (the tiny tool task's {lead})
                responses.append(response_template.format_map({**p.fields, "solution": p.solutions[0]}))
            except KeyError as e:
                raise ValueError(f"sft.response_template={response_template!r} names {e}, which the problem at "
                                 f"{p.source} lacks (its fields: {sorted(p.fields)})") from None
    prompts, dropped = build_prompts(questions, tokenizer, max_prompt_tokens=1 << 30, suffix=suffix)
    assert not dropped  # no length limit was asked for
    eos = tokenizer.eos_token_id
    return [(p.input_ids, tokenizer.encode(text, add_special_tokens=False) + [eos])
            for p, text in zip(prompts, responses)]


def sft_batch(pairs: list[tuple[list[int], list[int]]], *, pad_to_multiple_of: int = 1) -> PackedBatch:
    """Packs pairs; ``loss_mask`` marks the response tokens (the actor's logprob at
    position t scores token t, so the mask sits on the tokens themselves)."""
    if any(not r for _, r in pairs):
        raise ValueError("an SFT pair has an empty response")
    seqs = [torch.tensor(list(p) + list(r)) for p, r in pairs]
    masks = [torch.cat([torch.zeros(len(p)), torch.ones(len(r))]).bool() for p, r in pairs]
    return pack(seqs, {"loss_mask": masks}, pad_to_multiple_of=pad_to_multiple_of)


def sft_loss(logprobs_T: torch.Tensor, mb: PackedBatch, num_global_tokens: torch.Tensor,
             num_global_seqs: torch.Tensor | None = None):
    """NLL summed over this micro-batch's response tokens / all response tokens of the
    minibatch on every DP rank: the micro-batch losses add up to the token mean
    (``num_global_seqs``, the actor's other count, is unused)."""
    mask_T = mb.fields["loss_mask"].to(logprobs_T.dtype)
    nll = -(logprobs_T * mask_T).sum()
    return nll / num_global_tokens, {"nll_sum": nll.detach(), "tokens": mask_T.sum()}


def train_sft(actor, pairs, *, steps: int, batch_size: int, seed: int = 1) -> list[float]:
    """``steps`` optimizer steps on shuffled batches of ``pairs`` (epochs wrap around);
    returns the per-step mean NLL. Every rank passes the same pairs and takes its DP share."""
    g = actor.groups
    order: list[int] = []
    rng = random.Random(seed)
    losses = []
    for _ in range(steps):
        while len(order) < batch_size:
            epoch = list(range(len(pairs)))
            rng.shuffle(epoch)
            order += epoch
        batch, order = order[:batch_size], order[batch_size:]
        mine = [pairs[i] for i in batch[g.dp_rank::g.dp_size]]
        out = actor.train_batch(sft_batch(mine), sft_loss)
        losses.append(out["loss"][0])
    return losses


RECIPE_FILE = "sft.json"  # in sft.output_dir: what wrote the model there


def sft_optimizer(cfg):
    """The SFT's optimizer: the actor's, with ``sft.lr`` and ``sft.lr_scheduler`` where set
    (a PPO schedule, e.g. cosine decay over the RL steps, is not the warm-up's)."""
    s, o = cfg.sft, cfg.actor.optimizer
    return dataclasses.replace(o, lr=o.lr if s.lr is None else s.lr,
                               lr_scheduler=o.lr_scheduler if s.lr_scheduler is None else s.lr_scheduler)


def sft_recipe(cfg) -> dict:
    """Everything that decides the SFT's model: written beside it, compared by
    ``areal-mcore sft --if-changed`` so that a changed config retrains instead of reusing."""
    s = cfg.sft
    return {**dataclasses.asdict(s), "output_dir": None, "base_model": os.path.abspath(s.base_model),
            "lr": None, "lr_scheduler": None, "optimizer": dataclasses.asdict(sft_optimizer(cfg)),
            "seed": cfg.seed, "dataset": os.path.abspath(cfg.dataset.path),
            "instruction": cfg.dataset.instruction, "dtype": cfg.actor.dtype}


def sft_is_current(cfg) -> bool:
    """Whether sft.output_dir holds the model this very recipe wrote."""
    try:
        with open(os.path.join(cfg.sft.output_dir, RECIPE_FILE)) as f:
            return json.load(f) == sft_recipe(cfg)
    except (OSError, ValueError):
        return False


def run_sft(cfg) -> list[float]:
    """``areal-mcore sft``: cfg.sft.base_model -> cfg.sft.output_dir (every rank calls); its
    paths checked first, as the CLI checks them (``load_config`` does not)."""
    from areal_mcore.paths import check_run_paths

    check_run_paths(cfg, "sft")
    from transformers import AutoConfig, AutoTokenizer

    from areal_mcore.actor.megatron_actor import MegatronActor
    from areal_mcore.convert.hf_files import load_hf_state_dict
    from areal_mcore.convert.save_hf import save_hf
    from areal_mcore.data.jsonl import load_problems

    if cfg.sft is None or cfg.dataset is None:
        raise ValueError("sft needs the config sections 'sft' and 'dataset'")
    s = cfg.sft
    actor_cfg = dataclasses.replace(cfg.actor, optimizer=sft_optimizer(cfg))
    actor = MegatronActor(actor_cfg, AutoConfig.from_pretrained(s.base_model), seed=cfg.seed,
                          total_optimizer_steps=s.steps)
    actor.load_hf_state_dict(load_hf_state_dict(s.base_model))
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path or s.base_model)
    problems, _ = load_problems(cfg.dataset)
    pairs = sft_pairs(problems, tokenizer, response_template=s.response_template,
                      suffix=cfg.dataset.instruction)  # the prompts RL and eval will use
    losses = train_sft(actor, pairs,
                       steps=s.steps, batch_size=s.batch_size, seed=cfg.seed)
    save_hf(actor, s.output_dir, tokenizer_dir=cfg.tokenizer_path or s.base_model)
    if torch.distributed.get_rank() == 0:  # after the weights: a half-written folder has no recipe
        with open(os.path.join(s.output_dir, RECIPE_FILE), "w") as f:
            json.dump(sft_recipe(cfg), f, indent=1)
    return losses
