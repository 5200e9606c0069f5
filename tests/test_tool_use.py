"""Multi-turn tool use end to end: the ToolCalls episode (rollout/episodes/tool_use.py) on
the embedded server, its calculator calls run in the reward pool's workers, and PPO
training on the trajectories, token in and token out.

One seeded two-step run serves every check: the calls' observations are the calculator's
answers, appended as tokens with version -1; the trainer scores the agent's tokens after
an observation as the server generated them (drift ~1e-7: a trajectory decoded and
re-encoded between turns, or an observation counted as generated, would be far off); the
loss counts the agent's tokens only.
"""

from __future__ import annotations

import json

import pytest
import torch

from areal_mcore.config import load_config

pytestmark = [pytest.mark.server, pytest.mark.slow]


def _warm_up(model_dir: str, train: str, steps: int = 150) -> None:
    """A few seconds of plain-torch SFT on the call demonstrations (the test's setup, not
    what it checks): enough for the 1-layer model to open and close calls."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = [json.loads(x) for x in open(train)]
    seqs = []
    for r in rows:
        prompt = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]
        answer = tok.encode(f"{r['lead']}The answer is {r['solutions'][0]}.", add_special_tokens=False)
        seqs.append((list(prompt), answer + [tok.eos_token_id]))
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        batch = [seqs[i] for i in torch.randint(len(seqs), (16,), generator=g).tolist()]
        width = max(len(p) + len(a) for p, a in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        for i, (p, a) in enumerate(batch):
            ids[i, :len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p):len(p) + len(a)] = torch.tensor(a)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(model_dir)


def _ppo_worker(rank, world, overrides):
    from areal_mcore.trainer.ppo import train

    return train(load_config(None, overrides))


def test_a_tool_using_run_appends_the_calculators_answers_as_context_and_trains_on_the_agents_tokens(tmp_path):
    from _dist import run_gloo

    from areal_mcore.data.tiny_assets import TOOL_MARKERS, TinyAssetsConfig, build_tiny_assets
    from areal_mcore.reward.tool_call import calculator

    assets = build_tiny_assets(TinyAssetsConfig(out_dir=str(tmp_path / "assets"), n_train=256, n_test=4,
                                                hidden_size=32, intermediate_size=64, num_layers=1, levels=(4,),
                                                tool_demos=1.0, markers=TOOL_MARKERS))
    _warm_up(assets["model"], assets["train"])
    overrides = [
        "experiment_name=tool", f"model_path={assets['model']}", f"dataset.path={assets['train']}",
        "actor.vocab_divisible_by=8", "actor.mb_spec.max_tokens_per_mb=1024", "actor.optimizer.lr=1e-4",
        "actor.dtype=float32", "server.model_path=${model_path}", "server.dtype=float32",
        "server.context_length=256", "weight_sync.dtype=float32", "weight_sync.master_address=127.0.0.1",
        "reward.num_workers=1", "rollout.max_new_tokens=40", "rollout.n_samples=4",
        "rollout.episode=areal_mcore.rollout.episodes.tool_use:ToolCalls", "rollout.episode_args.max_turns=2",
        "ppo.reward_bias=-0.5", "ppo.reward_scaling=10.0", "trainer.batch_size=4", "trainer.total_steps=2",
        "trainer.dump_to_file=true", f"trainer.log_dir={tmp_path / 'runs'}", "trainer.progress=false"]
    (rows,) = run_gloo(_ppo_worker, 1, overrides)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["model"])
    start, end, obs_start, obs_end = (tok.convert_tokens_to_ids(m) for m in TOOL_MARKERS)
    called = 0
    for row in rows:
        dumped = [json.loads(x) for x in (tmp_path / "runs" / "tool" / "rollouts" / f"step_{row['step']}.jsonl")
                  .read_text().splitlines()]
        agent_tokens = 0
        for d in dumped:
            v, ids = d["versions"], d["response_ids"]
            agent_tokens += sum(x >= 0 for x in v)
            if -1 not in v:
                continue
            called += 1
            o = v.index(-1)  # the observation: <out> ... </out>, version -1, right after a call
            e = o
            while e + 1 < len(v) and v[e + 1] == -1:
                e += 1
            assert ids[o] == obs_start and ids[e] == obs_end and set(v[o:e + 1]) == {-1}, (ids, v)
            assert ids[o - 1] == end and v[o - 1] >= 0 and all(x >= 0 for x in v[e + 1:])
            args = tok.decode(ids[max((i for i in range(o) if ids[i] == start), default=-1) + 1:o - 1])
            got = tok.decode(ids[o + 1:e])
            try:
                assert got == calculator(args), (args, got)
            except ValueError:  # the model wrote something that is not arithmetic
                assert got.startswith("error: "), (args, got)
        assert row["train/loss_tokens"] == agent_tokens
        assert row["drift/tokens"] == agent_tokens and row["drift/gap_mean_abs"] < 1e-4, row["drift/gap_mean_abs"]
        assert 0.0 <= row["rollout/tool_call_rate"] <= 1.0
    assert called >= 8, f"only {called} of {len(rows) * 16} samples called the calculator"
