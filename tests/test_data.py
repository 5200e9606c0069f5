import json
import re

import pytest

from areal_mcore.data.jsonl import DatasetConfig, DatasetError, load_problems
from areal_mcore.data.sampler import EpochSampler
from areal_mcore.data.synthetic import generate, write_jsonl

GOOD = json.dumps({"prompt": "Compute 1 + 1.", "solutions": ["\\boxed{2}"]})


def _file(tmp_path, lines: list[bytes]):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


BAD_ROWS = [
    (b'{"prompt": "x", "solutions": [', "invalid JSON"),
    (b'{"prompt": "caf\xe9", "solutions": ["1"]}', "not valid UTF-8"),
    (b'{"solutions": ["1"]}', "missing field 'prompt'"),
    (b'{"prompt": "x"}', "missing field 'solutions'"),
    (b'{"prompt": "x", "solutions": []}', "non-empty list"),
    (b'{"prompt": "x", "solutions": [""]}', "non-empty list"),
    (b'{"prompt": "", "solutions": ["1"]}', "non-empty string"),
    (b'[1, 2]', "JSON object"),
]


@pytest.mark.parametrize("row, why", BAD_ROWS)
def test_bad_row_error_names_file_and_line(tmp_path, row, why):
    path = _file(tmp_path, [GOOD.encode(), b"", row])
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(path))}:3: .*{re.escape(why)}"):
        load_problems(DatasetConfig(path=str(path)))


def test_skip_bad_rows_counts_every_kind_and_says_which(tmp_path, capsys):
    path = _file(tmp_path, [GOOD.encode()] + [row for row, _ in BAD_ROWS] + [GOOD.encode()])
    problems, report = load_problems(DatasetConfig(path=str(path), skip_bad_rows=True))
    assert len(problems) == 2 and report.rows == 2 + len(BAD_ROWS)
    assert len(report.bad_rows) == len(BAD_ROWS)
    err = capsys.readouterr().err
    assert f"skipped {len(BAD_ROWS)} bad row(s) of {report.rows} in {path}" in err
    assert all(f"{path}:{i + 2}: " in err for i in range(len(BAD_ROWS)))  # each one, by file:line
    assert [p.source for p in problems] == [f"{path}:1", f"{path}:{len(BAD_ROWS) + 2}"]


def test_qa_and_messages_formats_map_their_fields(tmp_path):
    qa = _file(tmp_path, [json.dumps({"question": "2+2?", "answer": "4"}).encode()])
    (p,), _ = load_problems(DatasetConfig(path=str(qa), format="qa", prompt_key="question",
                                          solutions_key="answer"))
    assert (p.prompt, p.solutions) == ("2+2?", ("4",)) and p.fields == {}
    msgs = tmp_path / "m.jsonl"
    msgs.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "solutions": ["1"]}) + "\n")
    (m,), _ = load_problems(DatasetConfig(path=str(msgs), format="messages", prompt_key="messages"))
    assert m.prompt == (("user", "hi"),)
    with pytest.raises(ValueError, match="format='csv'"):
        DatasetConfig(path="x", format="csv")


def test_a_rows_other_columns_become_the_reward_fns_fields():
    import datetime

    from areal_mcore.data.jsonl import row_fields

    row = {"question": "q", "answer": "4", "difficulty": 3, "tags": ["a"], "solutions": "x", "source": "y",
           "when": datetime.date(2026, 1, 2)}
    # Not the columns the format read, nor reward.fn's own argument names; JSON or its str.
    assert row_fields(row, {"question", "answer"}) == {"difficulty": 3, "tags": ["a"], "when": "2026-01-02"}


def test_synthetic_task_is_seeded_correct_and_loads(tmp_path):
    rows = generate(300, seed=7)
    assert rows == generate(300, seed=7) and rows != generate(300, seed=8)
    assert {r["level"] for r in rows} == {1, 2, 3}
    for r in rows:
        answer = int(re.fullmatch(r"\\boxed\{(-?\d+)\}", r["solutions"][0]).group(1))
        if m := re.match(r"Compute (\d+) ([-+*]) (\d+)\.", r["prompt"]):
            a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
            assert answer == {"+": a + b, "-": a - b, "*": a * b}[op]
        else:
            m = re.match(r"Solve (\d+)x ([-+]) (\d+) = (-?\d+) for x\.", r["prompt"])
            a, sign, b, c = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
            assert a * answer + (b if sign == "+" else -b) == c
    problems, report = load_problems(DatasetConfig(path=str(write_jsonl(rows, tmp_path / "s.jsonl"))))
    assert len(problems) == 300 and not report.bad_rows


def test_sampler_resumes_exactly_and_reshuffles_each_epoch():
    full = EpochSampler(10, 4, seed=3)
    batches = [full.next_batch() for _ in range(7)]  # 2 batches per epoch, tail dropped
    assert set(batches[0]).isdisjoint(batches[1])  # no repeats within an epoch
    assert batches[0] != batches[2]  # each epoch has its own order
    first = EpochSampler(10, 4, seed=3)
    for _ in range(3):
        first.next_batch()
    resumed = EpochSampler(10, 4, seed=3)
    resumed.load_state_dict(first.state_dict())
    assert [resumed.next_batch() for _ in range(4)] == batches[3:]
    with pytest.raises(ValueError, match="fewer than batch_size"):
        EpochSampler(3, 4, seed=0)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path_factory.mktemp("tok")
    data = write_jsonl(generate(400, seed=1), out / "train.jsonl")
    subprocess.run([sys.executable, "scripts/build_tokenizer.py", "--data", str(data), "--out", str(out / "tok"),
                    "--vocab-size", "300"], cwd=Path(__file__).parents[1], check=True, capture_output=True)
    return out / "tok"


@pytest.mark.parametrize("text", ["Compute 17 + 25. Put the final answer in \\boxed{}.",
                                  "  héllo\twörld 😀\n\\frac{1}{2}  ", "x" * 300])
def test_trained_tokenizer_round_trips_text_exactly(tokenizer_dir, text):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert tok.decode(tok.encode(text)) == text


def test_prompts_use_the_chat_template_and_drop_long_ones(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from areal_mcore.data.prompts import BOBA_SUFFIX, build_prompts

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    rows = generate(20, seed=2) + [{"prompt": "Compute " + "9 + " * 400 + "1.", "solutions": ["\\boxed{3601}"]}]
    problems, _ = load_problems(DatasetConfig(path=str(write_jsonl(rows, tmp_path / "p.jsonl"))))
    prompts, dropped = build_prompts(problems, tok, max_prompt_tokens=200, suffix=BOBA_SUFFIX)
    assert dropped == 1 and len(prompts) == 20
    text = tok.decode(prompts[0].input_ids)
    assert text.startswith("<|im_start|>user\n" + rows[0]["prompt"]) and BOBA_SUFFIX in text
    assert text.endswith("<|im_start|>assistant\n")
    assert prompts[0].solutions == tuple(rows[0]["solutions"])


def _cli(*args):
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "areal_mcore.cli", *args],
                          cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_difficulty_filter_drops_problems_solved_k_of_k(tmp_path):
    rows = generate(3, seed=4)
    data = write_jsonl(rows, tmp_path / "d.jsonl")
    right = [r["solutions"][0] for r in rows]
    samples = [
        {"completions": [f"so {right[0]}"] * 8},  # always solved: dropped
        {"completions": [f"so {right[1]}"] * 7 + ["\\boxed{nope}"]},  # 7 of 8: kept
        {"completions": ["no answer"] * 8},  # never: kept
    ]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    summary = _cli("filter", "difficulty", "--data", str(data), "--samples", str(tmp_path / "s.jsonl"),
                   "--k", "8", "--out", str(tmp_path / "out.jsonl"))
    assert summary == {"problems": 3, "kept": 2, "dropped_solved": 1, "bad_rows": 0}
    assert (tmp_path / "out.jsonl").read_text().splitlines() == data.read_text().splitlines()[1:]


def test_length_filter_cli_drops_long_prompts(tokenizer_dir, tmp_path):
    rows = generate(5, seed=5) + [{"prompt": "Compute " + "9 + " * 400 + "1.", "solutions": ["\\boxed{3601}"]}]
    data = write_jsonl(rows, tmp_path / "d.jsonl")
    summary = _cli("filter", "length", "--data", str(data), "--tokenizer", str(tokenizer_dir),
                   "--max-prompt-tokens", "300", "--out", str(tmp_path / "out.jsonl"))
    assert summary == {"problems": 6, "kept": 5, "dropped_long": 1, "bad_rows": 0}
