"""One prompt builder for training, its eval, `areal-mcore eval` and SFT: the instruction
and thinking prefix come from the dataset's config; eval changes are opt-in and reported."""

from __future__ import annotations

import json

import pytest

from areal_mcore.config import InferenceConfig
from areal_mcore.data.jsonl import DatasetConfig, load_problems
from areal_mcore.data.prompts import BOBA_SUFFIX, instruction_for, prompts_for
from areal_mcore.data.synthetic import SUFFIX, generate, write_jsonl
from areal_mcore.data.tokenizer import build_tokenizer
from areal_mcore.eval.config import EvalConfig, eval_job
from areal_mcore.eval.run import prompt_config


@pytest.fixture(scope="module")
def tok():
    rows = generate(50, seed=1)
    return build_tokenizer([r["prompt"] for r in rows] + ["What is 2+2?", BOBA_SUFFIX], 300)


def _texts(ps, tok):
    return [tok.decode(p.input_ids) for p in ps.prompts]


def test_auto_instruction_adds_boba_suffix_only_to_rows_without_their_own(tok, tmp_path):
    synthetic = write_jsonl(generate(3, seed=2), tmp_path / "syn.jsonl")
    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"question": "What is 2+2?", "answer": "4"}) + "\n")
    syn = prompts_for(DatasetConfig(path=str(synthetic)), tok)
    assert syn.instructions == {"": 3}  # the rows already say "Put the final answer in \boxed{}."
    assert all(BOBA_SUFFIX not in t and SUFFIX in t for t in _texts(syn, tok))
    bare = prompts_for(DatasetConfig(path=str(qa), format="qa"), tok)
    assert bare.instructions == {BOBA_SUFFIX: 1}
    assert _texts(bare, tok)[0].startswith(f"<|im_start|>user\nWhat is 2+2?\n{BOBA_SUFFIX}<|im_end|>")
    # Explicit instructions apply to every row; "" adds none.
    none = prompts_for(DatasetConfig(path=str(qa), format="qa", instruction=""), tok)
    assert BOBA_SUFFIX not in _texts(none, tok)[0] and none.instructions == {"": 1}
    mine = prompts_for(DatasetConfig(path=str(synthetic), instruction="Think."), tok)
    assert all(t.split("<|im_end|>")[0].endswith("\nThink.") for t in _texts(mine, tok))


def test_chat_rows_are_used_as_written_whatever_the_instruction():
    (p,) = [type("P", (), {"prompt": (("user", "hi"),)})()]
    assert instruction_for(p, "auto") == "" and instruction_for(p, BOBA_SUFFIX) == ""


def test_eval_defaults_to_the_training_prompts_and_names_each_opt_in_change(tok, tmp_path, capsys):
    from areal_mcore.eval import run

    path = write_jsonl(generate(4, seed=3), tmp_path / "t.jsonl")
    d = DatasetConfig(path=str(path))
    def job(**kw):  # the run's eval set, evaluated on the run's model
        return eval_job(InferenceConfig(model_path="m", eval_dataset=d,
                                        eval=EvalConfig(model_kind="rl", max_new_tokens=8, **kw)))

    same, changes = prompt_config(d, job().eval)
    assert same == d and changes == []
    trained = prompts_for(d, tok, max_prompt_tokens=1024).prompts  # what trainer/ppo.py builds
    prompts, dropped, prefix, changes = run._prompts(d, job(), tok)
    assert [p.input_ids for p in prompts] == [p.input_ids for p in trained] and changes == []
    assert "prompts as in training" in capsys.readouterr().out
    prompts, _, prefix, changes = run._prompts(d, job(prompt_suffix=BOBA_SUFFIX, think="always"), tok)
    assert changes == [f"instruction {BOBA_SUFFIX!r} instead of 'auto'", "think=always instead of auto"]
    assert prefix == "<think>\n" and "DIFFER from training" in capsys.readouterr().out
    assert all(tok.decode(p.input_ids).endswith("<|im_start|>assistant\n<think>\n") for p in prompts)


def test_sft_prompts_are_the_rl_prompts(tok, tmp_path):
    from areal_mcore.trainer.sft import sft_pairs

    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"question": "What is 2+2?", "answer": "4"}) + "\n")
    d = DatasetConfig(path=str(qa), format="qa")
    (prompt, _), = sft_pairs(load_problems(d)[0], tok, suffix=d.instruction)
    assert prompt == prompts_for(d, tok).prompts[0].input_ids


def test_think_mode_is_validated_with_the_choices():
    with pytest.raises(ValueError, match=r"think='yes' is not allowed; choose one of \['auto', 'always', 'never'\]"):
        DatasetConfig(path="x", think="yes")
