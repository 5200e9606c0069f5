"""`areal-mcore eval`: the pass@k estimator, multiple-choice shuffling, boba's sampling and
server settings, `<think>` forcing, and one run end to end against an embedded server."""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction
from pathlib import Path

import pytest

from areal_mcore.cli import main
from areal_mcore.config import InferenceConfig, load_config
from areal_mcore.data.jsonl import LETTERS, DatasetConfig, DatasetError, Problem, load_problems
from areal_mcore.eval.choices import shuffle_choices
from areal_mcore.eval.config import EvalConfig, eval_job, eval_server_config, sampling
from areal_mcore.eval.passk import default_ks, pass_at_k, pass_at_ks
from areal_mcore.rollout.config import RolloutConfig, ServerConfig
from areal_mcore.rollout.episodes import EpisodeEnv
from areal_mcore.rollout.servers import server_command

# ---------------------------------------------------------------------------- pass@k


def test_pass_at_k_small_n_matches_enumerating_every_subset():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))  # samples 0..c-1 are correct
                brute = sum(any(i < c for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_matches_exact_binomials():
    for n, c, k in [(1000, 3, 100), (512, 0, 64), (512, 500, 16), (300, 150, 1)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-9)


def test_pass_at_k_k_over_n_names_both_numbers():
    with pytest.raises(ValueError, match="k=8 and n=4"):
        pass_at_k(4, 1, 8)


def test_pass_at_ks_pass1_is_the_mean_over_all_samples():
    out = pass_at_ks([0, 1, 4], n=4, ks=[1, 2, 4])
    assert out["pass@1"] == pytest.approx(5 / 12)
    assert out["pass@4"] == pytest.approx(2 / 3)  # problems with any correct sample
    assert out["pass@1"] <= out["pass@2"] <= out["pass@4"]
    assert default_ks(32) == [1, 2, 4, 8, 16, 32] and default_ks(6) == [1, 2, 4, 6] and default_ks(1) == [1]


# ---------------------------------------------------------------------------- multiple choice


def _mc_file(tmp_path, rows):
    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mc_rows_take_a_letter_or_an_index_and_bad_answers_name_file_and_line(tmp_path):
    path = _mc_file(tmp_path, [{"question": "Q1", "choices": ["x", "y", "z"], "answer": "b"},
                               {"question": "Q2", "choices": ["x", "y"], "answer": 0}])
    p1, p2 = load_problems(DatasetConfig(path=str(path), format="mc"))[0]
    assert (p1.prompt, p1.choices, p1.solutions) == ("Q1", ("x", "y", "z"), ("B",))
    assert p2.solutions == ("A",)
    bad = _mc_file(tmp_path, [{"question": "Q", "choices": ["x", "y"], "answer": "C"}])
    with pytest.raises(DatasetError, match=r"mc.jsonl:1: 'answer' must be one of the letters \['A', 'B'\]"):
        load_problems(DatasetConfig(path=str(bad), format="mc"))


def _gold_a(n: int) -> list[Problem]:
    return [Problem(prompt=f"Question {i}?", solutions=("A",), source=f"f:{i}",
                    choices=(f"right {i}", f"wrong {i}a", f"wrong {i}b", f"wrong {i}c")) for i in range(n)]


def test_shuffle_choices_is_seeded_and_moves_the_gold_letter_with_its_option():
    problems = _gold_a(40)
    shuffled = shuffle_choices(problems, seed=3)
    assert shuffled == shuffle_choices(problems, seed=3)
    assert shuffled != shuffle_choices(problems, seed=4)
    for before, after in zip(problems, shuffled):
        (gold,) = after.solutions
        assert after.choices[LETTERS.index(gold)] == before.choices[0]  # the right option
        assert sorted(after.choices) == sorted(before.choices)
    golds = [p.solutions[0] for p in shuffled]
    assert len(set(golds)) == 4 and golds.count("A") < 20  # GPQA's all-'A' gold is gone
    plain = Problem(prompt="2+2?", solutions=("4",), source="f:0")
    assert shuffle_choices([plain], seed=3) == [plain]


# ---------------------------------------------------------------------------- settings


def test_sampling_defaults_follow_the_model_kind_unless_overridden():
    assert sampling(EvalConfig(model_kind="rl")) == (1.0, 1.0)
    assert sampling(EvalConfig(model_kind="sft")) == (0.6, 0.95)
    assert sampling(EvalConfig(model_kind="base")) == (0.6, 0.95)
    assert sampling(EvalConfig(model_kind="sft", temperature=0.0, top_p=1.0)) == (0.0, 1.0)
    assert EvalConfig(model_kind="rl").n_samples == 32
    with pytest.raises(ValueError, match=r"model_kind='ppo' is not allowed; choose one of \['rl', 'sft', 'base'\]"):
        EvalConfig(model_kind="ppo")
    with pytest.raises(ValueError, match="k=64 and n_samples=32"):
        EvalConfig(model_kind="rl", ks=[1, 64])


def test_eval_servers_get_the_long_context_sglang_flags_and_embedded_none(tmp_path):
    sglang = ServerConfig(model_path=str(tmp_path), backend="sglang", extra_args=["--log-level", "warning"])
    cmd = server_command(eval_server_config(sglang), port=30000, seed=1)
    assert "--disable-cuda-graph" in cmd
    i = cmd.index("--chunked-prefill-size")
    assert cmd[i + 1] == "-1"
    assert cmd.index("--log-level") > i  # the user's extra_args come last and win
    embedded = server_command(eval_server_config(ServerConfig(model_path=str(tmp_path))), port=30000, seed=1)
    assert "--disable-cuda-graph" not in embedded and "--chunked-prefill-size" not in embedded
    (tmp_path / "config.json").write_text(json.dumps({"use_sliding_window": True}))
    with pytest.raises(ValueError, match="use_sliding_window is true"):
        eval_server_config(sglang)


# ---------------------------------------------------------------------------- <think> forcing


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from areal_mcore.data.tiny_assets import TinyAssetsConfig, build_tiny_assets

    return build_tiny_assets(TinyAssetsConfig(out_dir=str(tmp_path_factory.mktemp("assets")), n_train=200,
                                              n_test=6, hidden_size=64, intermediate_size=128, num_layers=2))


QWEN3_LIKE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
              "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
R1_LIKE = QWEN3_LIKE.replace("<|im_start|>assistant\n{%", "<|im_start|>assistant\n<think>\n{%")


def test_think_prefix_is_appended_only_where_the_template_thinks(assets):
    from transformers import AutoTokenizer

    from areal_mcore.data.prompts import build_prompts
    from areal_mcore.eval.run import think_prefix

    tok = AutoTokenizer.from_pretrained(assets["model"])
    problems = [Problem(prompt="Compute 1 + 2.", solutions=("3",), source="f:1")]
    (plain,), _ = build_prompts(problems, tok)
    assert think_prefix(tok, "auto") is None  # the tiny template has no thinking
    assert think_prefix(tok, "always") == "<think>\n"
    tok.chat_template = QWEN3_LIKE
    (base,), _ = build_prompts(problems, tok)
    assert base.input_ids == plain.input_ids  # same rendering without enable_thinking
    prefix = think_prefix(tok, "auto")
    assert prefix == "<think>\n" and think_prefix(tok, "never") is None
    (forced,), _ = build_prompts(problems, tok, force_prefix=prefix)
    assert forced.input_ids == base.input_ids + tok.encode("<think>\n", add_special_tokens=False)
    assert forced.solutions == ("3",)  # the reward still scores the response alone
    tok.chat_template = R1_LIKE  # the template opens <think> itself: never twice
    assert think_prefix(tok, "auto") is None and think_prefix(tok, "always") is None


def test_correct_samples_are_counted_per_problem(monkeypatch):
    """Groups of n samples map back to their problem: a fake fleet whose reward marks the
    first ``c`` samples of a problem correct, with ``c`` written in the problem's gold."""
    import asyncio

    from areal_mcore.data.prompts import Prompt
    from areal_mcore.eval import run
    from areal_mcore.rollout import client as client_mod

    configs = []

    class FakeClient:
        def __init__(self, cfg):
            self.calls = {}  # per prompt: the k-th request gets output [k]
            configs.append(cfg)

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            pass

        async def generate(self, input_ids, sampling, *, rid, group=None):
            j = self.calls[tuple(input_ids)] = self.calls.get(tuple(input_ids), -1) + 1
            return client_mod.Completion(rid=rid, input_ids=input_ids, output_ids=[j], logprobs=[0.0],
                                         versions=["0"], finish_reason={"type": "stop"})

    async def reward(items):
        return [float(int(i.completion) < int(i.solutions[0])) for i in items]

    monkeypatch.setattr(client_mod, "RolloutClient", FakeClient)
    wanted = [[3, 0, 4], [1]]
    data = [(DatasetConfig(path=f"d{i}.jsonl"), [Prompt(input_ids=[i, j], solutions=(str(c),), source=f"d{i}:{j}")
                                                 for j, c in enumerate(cs)], 0) for i, cs in enumerate(wanted)]
    decode = lambda ids: str(ids[0])  # noqa: E731
    # The run's rollout section sets the client's request policy, as for the run's own client.
    policy = RolloutConfig(max_new_tokens=8, stall_after_s=123.0, min_request_deadline_s=45.0, max_bad_answers=7)
    job = eval_job(InferenceConfig(eval=EvalConfig(model_kind="rl", n_samples=4, ks=[2, 4], data=["x.jsonl"]),
                                   server=ServerConfig(model_path="m"), rollout=policy))
    rows = asyncio.run(run._sample(job, ["fake:1"], EpisodeEnv(score=reward, decode=decode), data))
    (client,) = configs
    assert (client.stall_after_s, client.min_deadline_s, client.max_bad_answers) == (123.0, 45.0, 7)
    assert client.max_connections == job.eval.max_concurrent_rollouts * 4  # eval's own concurrency
    assert [[p["correct"] for p in r["per_problem"]] for r in rows] == wanted
    assert rows[0]["pass@1"] == pytest.approx(7 / 12) and rows[0]["pass@4"] == pytest.approx(2 / 3)
    assert rows[1]["pass@2"] == pytest.approx(pass_at_k(4, 1, 2))


# ---------------------------------------------------------------------------- CLI


TINY = Path(__file__).parents[1] / "configs" / "tiny_cpu.yaml"


class _Started(Exception):
    pass


def _job_of(monkeypatch, *args: str):
    """The EvalJob `areal-mcore eval ARGS` would run, caught where evaluation would start."""
    def evaluate(job):
        raise _Started(job)

    monkeypatch.setattr("areal_mcore.eval.evaluate", evaluate)
    monkeypatch.setattr("areal_mcore.paths.check_eval_paths", lambda job: None)
    with pytest.raises(_Started) as e:
        main(["eval", *args])
    return e.value.args[0]


@pytest.mark.parametrize("args, message", [
    (["--model-kind", "ppo"], "eval.model_kind='ppo' is not allowed; choose one of ['rl', 'sft', 'base']"),
    (["--model-kind", "rl", "eval.n_samples=0"], "eval.n_samples=0 must be > 0"),
    (["--model-kind", "rl", "--k", "1,8", "--n-samples", "4"],
     "pass@8 needs k <= n_samples, got k=8 and n_samples=4"),
    (["--model-kind", "rl", "--k", "1,x"], "config key 'eval.ks[1]' expects int, got 'x'"),
    ([], "missing required config value 'eval.model_kind'"),
])
def test_eval_cli_bad_values_name_the_key_and_what_to_fix(args, message, capsys):
    assert main(["eval", "--model", "m", "--data", "x.jsonl", *args]) == 2
    assert message in capsys.readouterr().err


def test_eval_cli_without_data_names_the_flag(capsys):
    assert main(["eval", "--model", "m", "--model-kind", "sft"]) == 2
    assert "give --data a.jsonl[,b.jsonl]" in capsys.readouterr().err


def test_eval_flags_and_the_overrides_they_stand_for_give_the_same_job(monkeypatch):
    flags = _job_of(monkeypatch, "--model", "m", "--data", "a.jsonl,b.jsonl", "--model-kind", "sft",
                    "--n-samples", "8", "--k", "1,8", "--prompt-suffix", "", "--shuffle-choices",
                    "--server-url", "http://h:1", "--out", "r.json")
    keys = _job_of(monkeypatch, "server.model_path=m", "eval.data=[a.jsonl,b.jsonl]", "eval.model_kind=sft",
                   "eval.n_samples=8", "eval.ks=[1,8]", "eval.prompt_suffix=''", "eval.shuffle_choices=true",
                   "server.addresses=[h:1]", "eval.out=r.json")
    assert flags == keys
    assert (flags.eval.ks, flags.eval.prompt_suffix, flags.server.addresses) == ([1, 8], "", ["h:1"])


def test_eval_defaults_come_from_the_experiment_sections(monkeypatch):
    run = load_config(TINY)
    job = _job_of(monkeypatch, "--config", str(TINY), "--model-kind", "rl")
    assert job.server == run.server and job.server.model_path == run.model_path == job.tokenizer_path
    assert job.datasets == [run.eval_dataset] and job.reward == run.reward and job.rollout == run.rollout
    e = job.eval
    assert (e.seed, e.max_new_tokens, e.max_prompt_tokens) == (run.rollout.seed + 1, run.rollout.max_new_tokens,
                                                                run.trainer.max_prompt_tokens)
    # --data files are read as the run's eval set; in another format, as plain rows of it.
    same = _job_of(monkeypatch, "--config", str(TINY), "--model-kind", "rl", "--data", "o.jsonl",
                   "eval_dataset.instruction=''")
    assert same.datasets[0] == DatasetConfig(path="o.jsonl", instruction="")
    qa = _job_of(monkeypatch, "--config", str(TINY), "--model-kind", "rl", "--data", "o.jsonl",
                 "--data-format", "qa", "eval_dataset.instruction=''")
    assert qa.datasets[0] == DatasetConfig(path="o.jsonl", format="qa")
    # Without --config, the keys' own defaults.
    bare = _job_of(monkeypatch, "--model", "m", "--data", "o.jsonl", "--model-kind", "rl").eval
    assert (bare.seed, bare.max_new_tokens, bare.max_prompt_tokens) == (1, 27648, None)


@pytest.mark.server
def test_eval_end_to_end_two_datasets_against_an_embedded_server(assets, tmp_path, capsys):
    rows = [json.loads(line) for line in open(assets["test"])]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[2:5]))
    config = tmp_path / "eval.yaml"  # the training config's sections, reused by eval
    config.write_text(f"""experiment_name: eval-test
model_path: {assets['model']}
actor:
  mb_spec: {{max_tokens_per_mb: 512}}
  optimizer: {{lr: 1.0e-4}}
server:
  model_path: ${{model_path}}
  dtype: float32
  context_length: 256
  max_running_requests: 16
reward:
  num_workers: 1
""")
    out = tmp_path / "report.json"
    rc = main(["eval", "--config", str(config), "--data", f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}",
               "--model-kind", "sft", "--n-samples", "4", "--k", "1,2,4", "--max-new-tokens", "8",
               "--out", str(out), "server.startup_timeout_s=120"])
    captured = capsys.readouterr()
    printed = captured.out
    assert rc == 0
    # A bar per dataset while it samples (it was silent for the whole sampling), on stderr.
    assert "a: 100%" in captured.err and " 2/2 " in captured.err and "b: 100%" in captured.err, captured.err
    report = json.loads(out.read_text())
    assert (report["temperature"], report["top_p"], report["n_samples"]) == (0.6, 0.95, 4)
    # The training prompts: the tiny rows carry their own \boxed instruction, so none is added.
    assert report["response_prefix"] == "" and report["prompt_suffix"] is None and report["prompt_changes"] == []
    assert "prompts as in training (instruction 'auto': 2 x none" in printed
    assert report["servers"] == {"backend": "embedded", "extra_args": []}
    assert [(d["dataset"], d["problems"], d["samples"]) for d in report["datasets"]] == [("a", 2, 8), ("b", 3, 12)]
    for d in report["datasets"]:
        assert 0.0 <= d["pass@1"] <= d["pass@2"] <= d["pass@4"] <= 1.0
        assert d["pass@1"] == pytest.approx(sum(p["correct"] for p in d["per_problem"]) / d["samples"])
        assert 0 < d["response_len_mean"] <= 8
    assert (tmp_path / "report_servers" / "server0.log").is_file()  # server logs beside the report
    assert "pass@4" in printed and f"report written to {out}" in printed
