"""dataset.path as JSONL, JSON, Parquet, a folder of files, a save_to_disk folder or a hub
id: the same problems, prompts and errors (with row numbers), and the same training."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import datasets
import pytest
from _dist import run_gloo

from areal_mcore.data.jsonl import DatasetConfig, DatasetError, load_problems
from areal_mcore.data.synthetic import generate, write_jsonl


def _forms(rows, tmp_path) -> dict[str, str]:
    """The same rows as each kind of dataset.path."""
    ds = datasets.Dataset.from_list(rows)
    out = {"jsonl": str(write_jsonl(rows, tmp_path / "d.jsonl"))}
    ds.to_parquet(str(tmp_path / "d.parquet"))
    out["parquet"] = str(tmp_path / "d.parquet")
    (tmp_path / "d.json").write_text(json.dumps(rows))  # one JSON array
    out["json"] = str(tmp_path / "d.json")
    (tmp_path / "shards").mkdir()
    half = len(rows) // 2
    ds.select(range(half)).to_parquet(str(tmp_path / "shards" / "part-0.parquet"))
    write_jsonl(rows[half:], tmp_path / "shards" / "part-1.jsonl")  # mixed file types, sorted
    out["folder"] = str(tmp_path / "shards")
    ds.save_to_disk(str(tmp_path / "saved"))
    out["saved"] = str(tmp_path / "saved")
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "saved_dict"))
    out["saved_dict"] = str(tmp_path / "saved_dict")
    return out


def test_every_form_loads_the_same_problems_and_prompts(tmp_path):
    from transformers import AutoTokenizer

    from areal_mcore.data.prompts import prompts_for
    from areal_mcore.data.tiny_assets import TinyAssetsConfig, build_tiny_assets

    assets = build_tiny_assets(TinyAssetsConfig(out_dir=str(tmp_path / "assets"), n_train=40, n_test=4,
                                                hidden_size=32, intermediate_size=64, num_layers=1))
    tok = AutoTokenizer.from_pretrained(assets["model"])
    rows = [json.loads(line) for line in open(assets["train"])]
    forms = _forms(rows, tmp_path)
    ref = load_problems(DatasetConfig(path=forms["jsonl"]))[0]
    ref_ids = [p.input_ids for p in prompts_for(DatasetConfig(path=forms["jsonl"]), tok).prompts]
    for name, path in forms.items():
        cfg = DatasetConfig(path=path, split="test" if name == "saved_dict" else "train")
        got = load_problems(cfg)[0]
        assert [(p.prompt, p.solutions) for p in got] == [(p.prompt, p.solutions) for p in ref], name
        assert [p.input_ids for p in prompts_for(cfg, tok).prompts] == ref_ids, name
        assert [p.fields for p in got] == [{"level": r["level"]} for r in rows], name  # for reward.fn
    assert load_problems(DatasetConfig(path=forms["parquet"]))[0][2].source == f"{forms['parquet']} row 3"
    with pytest.raises(ValueError, match=r"has splits \['test'\], not split='train': set dataset.split"):
        load_problems(DatasetConfig(path=forms["saved_dict"]))


def test_a_bad_parquet_row_is_named_by_its_row_number_or_skipped(tmp_path):
    rows = generate(5, seed=1)
    rows[2] = {**rows[2], "solutions": []}
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "bad.parquet"))
    path = str(tmp_path / "bad.parquet")
    with pytest.raises(DatasetError, match=r"bad.parquet row 3: 'solutions' must be a non-empty list"):
        load_problems(DatasetConfig(path=path))
    problems, report = load_problems(DatasetConfig(path=path, skip_bad_rows=True))
    assert len(problems) == 4 and report.rows == 5 and len(report.bad_rows) == 1
    qa = [{"question": "1+1?"}, {"question": "2+2?", "answer": "4"}]  # a column missing in row 1
    (tmp_path / "qa.json").write_text("\n".join(json.dumps(r) for r in qa))  # JSON lines in a .json
    with pytest.raises(DatasetError, match=r"qa.json row 1: 'answer' must be a non-empty list"):
        load_problems(DatasetConfig(path=str(tmp_path / "qa.json"), format="qa"))


def test_a_hub_id_goes_to_datasets_and_an_uncached_one_offline_is_one_line(tmp_path):
    # No network in tests: offline, the hub path reads only the local cache, which is empty.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    code = ("from areal_mcore.data.jsonl import DatasetConfig, load_problems\n"
            "load_problems(DatasetConfig(path='inclusionAI/AReaL-boba-Data', split='train'))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0
    assert last.startswith("FileNotFoundError: dataset inclusionAI/AReaL-boba-Data: cannot load it with "
                           "datasets.load_dataset"), proc.stderr[-2000:]


def _first_step(rank, world, overrides):
    from areal_mcore.config import load_config
    from areal_mcore.trainer.ppo import train

    return train(load_config(None, overrides))


@pytest.mark.slow
@pytest.mark.server
def test_a_run_on_a_parquet_file_trains_on_the_jsonls_prompts(tmp_path):
    """The trainer's own path (config -> rollout side -> prompts_for) on a Parquet file: its
    first batch is the one the same seed draws from the JSONL's prompts. (Every form loading
    the same prompts, the saved folder's included, is the first test's: one run stands for
    them; three runs, one per form, took 78 s of a worker.)"""
    from transformers import AutoTokenizer

    from areal_mcore.config import load_config
    from areal_mcore.data.prompts import prompts_for
    from areal_mcore.data.sampler import EpochSampler
    from areal_mcore.data.tiny_assets import TinyAssetsConfig, build_tiny_assets

    assets = build_tiny_assets(TinyAssetsConfig(out_dir=str(tmp_path / "assets"), n_train=32, n_test=4,
                                                hidden_size=32, intermediate_size=64, num_layers=1))
    forms = _forms([json.loads(line) for line in open(assets["train"])], tmp_path)
    overrides = [
        "experiment_name=parquet", f"model_path={assets['model']}", f"dataset.path={forms['parquet']}",
        "actor.vocab_divisible_by=8", "actor.mb_spec.max_tokens_per_mb=512", "actor.optimizer.lr=1e-4",
        "server.model_path=${model_path}", "server.dtype=float32", "weight_sync.dtype=float32",
        "weight_sync.master_address=127.0.0.1", "reward.num_workers=1", "trainer.batch_size=2",
        "trainer.total_steps=1", f"trainer.log_dir={tmp_path / 'runs'}", "trainer.progress=false",
        "trainer.tensorboard=false", "trainer.dump_to_file=true", "rollout.max_new_tokens=8", "rollout.n_samples=2",
        "server.context_length=256",
        # Every token's advantage is -5 without normalisation: a non-zero loss.
        "ppo.reward_bias=-0.5", "ppo.reward_scaling=10.0"]
    (row,) = run_gloo(_first_step, 1, overrides)[0]
    assert (tmp_path / "runs" / "parquet" / "stats.jsonl").is_file()
    assert all(loss != 0 for loss in row["train/loss"])
    cfg = load_config(None, overrides)
    tok = AutoTokenizer.from_pretrained(assets["model"])
    jsonl = prompts_for(DatasetConfig(path=forms["jsonl"]), tok).prompts
    first = EpochSampler(len(jsonl), cfg.trainer.batch_size, cfg.seed).next_batch()
    dumped = [json.loads(x) for x in (tmp_path / "runs" / "parquet" / "rollouts" / "step_1.jsonl").open()]
    assert sorted({d["prompt"] for d in dumped}) == sorted(
        tok.decode(jsonl[i].input_ids, skip_special_tokens=True) for i in first)
