"""SFT: the packed batch, the loss normalisation, and a tiny actor learning the format."""

from __future__ import annotations

import pytest
import torch
from _dist import run_gloo

from areal_mcore.data.jsonl import Problem
from areal_mcore.data.synthetic import generate
from areal_mcore.data.tokenizer import build_tokenizer
from areal_mcore.packing import unpack
from areal_mcore.trainer.sft import sft_batch, sft_loss, sft_pairs


def _tokenizer_and_problems(n=32):
    rows = generate(n, seed=3, levels=(1,))
    tok = build_tokenizer([r["prompt"] for r in rows] + [s for r in rows for s in r["solutions"]], 300)
    problems = [Problem(prompt=r["prompt"], solutions=tuple(r["solutions"]), source=f"t:{i}")
                for i, r in enumerate(rows)]
    return tok, problems


def test_pairs_end_in_eos_and_the_mask_covers_exactly_the_response():
    tok, problems = _tokenizer_and_problems(4)
    pairs = sft_pairs(problems, tok)
    assert all(r[-1] == tok.eos_token_id for _, r in pairs)
    assert tok.decode(pairs[0][1][:-1]) == f"The answer is {problems[0].solutions[0]}."
    batch = sft_batch(pairs, pad_to_multiple_of=4)
    seqs, f = unpack(batch)
    for (p, r), s, m in zip(pairs, seqs, f["loss_mask"]):
        assert s.tolist() == p + r and m.tolist() == [False] * len(p) + [True] * len(r)
    logp = -torch.rand(batch.input_ids.numel())
    loss, stats = sft_loss(logp, batch, torch.tensor(20.0))
    mask = batch.fields["loss_mask"]
    assert torch.isclose(loss, -(logp[mask]).sum() / 20) and stats["tokens"] == mask.sum()


def test_a_written_assistant_turn_is_the_response_and_not_part_of_the_prompt():
    tok, problems = _tokenizer_and_problems(1)
    written = Problem(prompt=(("user", "1 + 2 = ?"), ("assistant", "1 plus 2 is 3. \\boxed{3}")),
                      solutions=("3",), source="t:9")
    (prompt, response), (plain_prompt, _) = sft_pairs([written, problems[0]], tok)
    assert tok.decode(response[:-1]) == "1 plus 2 is 3. \\boxed{3}" and response[-1] == tok.eos_token_id
    asked = Problem(prompt=(("user", "1 + 2 = ?"),), solutions=("3",), source="t:9")
    assert prompt == sft_pairs([asked], tok)[0][0]  # the chat up to the assistant's turn
    assert tok.decode(sft_pairs([problems[0]], tok)[0][0]) == tok.decode(plain_prompt)


def _sft_worker(rank, world):
    from transformers import Qwen2Config

    from areal_mcore.actor.config import ActorConfig, MicroBatchSpec, OptimizerConfig
    from areal_mcore.actor.megatron_actor import MegatronActor
    from areal_mcore.trainer.sft import train_sft

    tok, problems = _tokenizer_and_problems(32)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    actor = MegatronActor(ActorConfig(mb_spec=MicroBatchSpec(max_tokens_per_mb=512),
                                      optimizer=OptimizerConfig(lr=3e-3), vocab_divisible_by=8), config)
    return train_sft(actor, sft_pairs(problems, tok), steps=30, batch_size=16)


@pytest.mark.multirank
def test_sft_on_two_dp_ranks_learns_the_answer_format():
    losses = run_gloo(_sft_worker, 2)
    assert losses[0] == losses[1]  # the loss is the same global token mean on both ranks
    first, last = losses[0][0], losses[0][-1]
    assert all(torch.isfinite(torch.tensor(losses[0])))
    assert last < 0.5 * first, (first, last)
    print(f"SFT NLL {first:.3f} -> {last:.3f}")


def test_if_changed_keeps_a_model_only_its_own_recipe_wrote(tmp_path):
    """`areal-mcore sft --if-changed` (make run) retrains when the config's SFT changed, e.g.
    a new sft.steps, instead of reusing the folder an older recipe wrote."""
    import json

    from areal_mcore.config import load_config
    from areal_mcore.trainer.sft import RECIPE_FILE, sft_is_current, sft_recipe

    def cfg(*overrides):
        return load_config("configs/tiny_cpu.yaml", [f"sft.output_dir={tmp_path}", *overrides])

    assert not sft_is_current(cfg())  # no sft.json: a model from before the recipe was recorded
    (tmp_path / RECIPE_FILE).write_text(json.dumps(sft_recipe(cfg())))
    assert sft_is_current(cfg())
    for changed in ("sft.steps=7", "sft.lr=1e-3", "seed=2", "sft.base_model=elsewhere", "dataset.path=other.jsonl",
                    "sft.lr_scheduler=linear", "actor.optimizer.weight_decay=0.1"):
        assert not sft_is_current(cfg(changed)), changed
    # The PPO schedule is not the warm-up's: the tiny config pins sft.lr_scheduler.
    assert sft_is_current(cfg("actor.optimizer.lr_scheduler=linear"))
    unset = sft_recipe(cfg("sft.lr=null", "sft.lr_scheduler=null"))["optimizer"]  # unset: the actor's
    assert (unset["lr"], unset["lr_scheduler"]) == (cfg().actor.optimizer.lr, cfg().actor.optimizer.lr_scheduler)
