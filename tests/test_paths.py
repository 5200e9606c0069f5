"""Every path-valued key is checked before any process group, server or worker starts:
exit 2 with one line naming the key, the value and what was expected."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from areal_mcore.cli import main
from areal_mcore.data.synthetic import generate, write_jsonl


@pytest.fixture
def good(tmp_path):
    """Paths that pass every check: a model folder, a dataset, a log folder."""
    model = tmp_path / "model"
    model.mkdir()
    from transformers import Qwen2Config

    # A real (tiny) config: the pre-start plan check (issue 17) reads it before the paths.
    Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=64).to_json_file(model / "config.json")
    (model / "model.safetensors").write_bytes(b"{}")
    (model / "tokenizer.json").write_text("{}")
    data = write_jsonl(generate(4, seed=0), tmp_path / "train.jsonl")
    return {"model": model, "data": data, "logs": tmp_path / "runs"}


def _train(good, *overrides: str, command: str = "train") -> list[str]:
    return [command, "--config", "configs/tiny_cpu.yaml", f"model_path={good['model']}",
            f"dataset.path={good['data']}", f"eval_dataset.path={good['data']}",
            f"trainer.log_dir={good['logs']}", f"sft.base_model={good['model']}",
            f"sft.output_dir={good['logs'] / 'sft'}", *overrides]


def _one_line_error(capsys, rc: int) -> str:
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err, err
    assert not dist.is_initialized()  # nothing started before the check
    return err


def test_nonexistent_model_path_names_the_key_and_what_a_model_folder_holds(good, capsys):
    err = _one_line_error(capsys, main(_train(good, "model_path=/nonexistent")))
    assert err.startswith("areal-mcore train: error: model_path=/nonexistent: no such file or folder")
    assert "expected an HF model folder with config.json and *.safetensors weights" in err


def test_a_model_folder_without_weights_is_refused(good, capsys):
    (good["model"] / "model.safetensors").unlink()
    err = _one_line_error(capsys, main(_train(good)))
    assert f"model_path={good['model']}: the folder has config.json but no weights" in err
    err = _one_line_error(capsys, main(_train(good, command="sft")))
    assert f"sft.base_model={good['model']}: the folder has config.json but no weights" in err


def test_a_folder_without_config_json_is_not_a_model(good, tmp_path, capsys):
    err = _one_line_error(capsys, main(_train(good, f"model_path={tmp_path}")))
    assert f"model_path={tmp_path}: the folder has no config.json" in err


def test_unreadable_datasets_name_the_key(good, tmp_path, capsys):
    # Root reads any file whatever its mode bits; /proc/self/mem refuses a read at offset 0
    # (EIO) for everyone, so a dataset linked to it is unreadable on every machine.
    unreadable = tmp_path / "bad.jsonl"
    os.symlink("/proc/self/mem", unreadable)
    err = _one_line_error(capsys, main(_train(good, f"dataset.path={unreadable}")))
    assert f"dataset.path={unreadable}: cannot read" in err and "expected a JSONL, JSON or Parquet file" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    err = _one_line_error(capsys, main(_train(good, f"eval_dataset.path={empty}")))
    assert f"eval_dataset.path={empty}: the folder holds no .jsonl/.json/.parquet file" in err
    err = _one_line_error(capsys, main(_train(good, f"dataset.path={tmp_path / 'nope.jsonl'}")))
    assert f"dataset.path={tmp_path / 'nope.jsonl'}: no such file or folder" in err
    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    err = _one_line_error(capsys, main(_train(good, f"dataset.path={notes}", command="sft")))
    assert f"dataset.path={notes}: .txt extension" in err


def test_non_writable_log_dirs_name_the_key(good, tmp_path, capsys):
    # procfs refuses new files even to root; a path under a regular file cannot be created.
    err = _one_line_error(capsys, main(_train(good, "trainer.log_dir=/proc/areal-runs")))
    assert err.startswith("areal-mcore train: error: trainer.log_dir=/proc/areal-runs: cannot write in /proc")
    blocker = tmp_path / "file"
    blocker.write_text("")
    err = _one_line_error(capsys, main(_train(good, f"sft.output_dir={blocker / 'out'}", command="sft")))
    assert f"sft.output_dir={blocker / 'out'}: {blocker} is a file, not a folder" in err


def test_eval_filter_and_convert_check_their_paths_first(good, tmp_path, capsys):
    rc = main(["eval", "--model", "/nonexistent", "--data", str(good["data"]), "--model-kind", "rl"])
    assert "server.model_path=/nonexistent: no such file or folder" in _one_line_error(capsys, rc)
    rc = main(["eval", "--model", str(good["model"]), "--data", str(tmp_path / "x.jsonl"), "--model-kind", "rl"])
    assert f"eval.data={tmp_path / 'x.jsonl'}: no such file or folder" in _one_line_error(capsys, rc)
    rc = main(["eval", "--model", str(good["model"]), "--data", str(good["data"]), "--model-kind", "rl",
               "--out", "/proc/areal/report.json"])
    assert "eval.out=/proc/areal: cannot write in /proc" in _one_line_error(capsys, rc)
    rc = main(["filter", "difficulty", "--data", str(good["data"]), "--samples", str(tmp_path / "s.jsonl"),
               "--out", str(tmp_path / "o.jsonl")])
    assert f"filter.samples={tmp_path / 's.jsonl'}: no such file or folder" in _one_line_error(capsys, rc)
    rc = main(["filter", "difficulty", "--data", str(good["data"]), "--out", str(tmp_path / "o.jsonl")])
    assert "filter difficulty needs samples or a model to draw them from" in _one_line_error(capsys, rc)
    rc = main(["convert", "hf-to-mcore", "--input", str(tmp_path), "--output", str(tmp_path / "ck")])
    assert f"--input={tmp_path}: the folder has no config.json" in _one_line_error(capsys, rc)


def test_a_hub_id_that_is_no_local_path_is_left_to_the_loader():
    from areal_mcore.paths import check_dataset, is_hub_id

    assert is_hub_id("inclusionAI/AReaL-boba-Data") and not is_hub_id("./a/b") and not is_hub_id("a/b/c")
    check_dataset("dataset.path", "inclusionAI/AReaL-boba-Data")  # no raise: datasets resolves it


def test_an_empty_dataset_file_a_taken_base_port_and_too_many_minibatches_are_named(good, tmp_path, capsys):
    """Three gaps that started ranks (or servers) first: an empty dataset file ended in
    the sampler's 'dataset has 0 problems' naming no file; a base port held by a listener
    that is no server ended in errno 98 inside a traceback 33 s later; 1000 minibatches
    of 64 samples ran 936 optimizer steps on nothing."""
    import socket

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    err = _one_line_error(capsys, main(_train(good, f"dataset.path={empty}")))
    assert f"dataset.path={empty}: the file is empty" in err
    with socket.socket() as listener:  # not HTTP: it accepts and never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        err = _one_line_error(capsys, main(_train(good, f"server.base_port={port}")))
    assert f"server.base_port={port} cannot be used: port {port} is taken by pid {os.getpid()} " in err
    err = _one_line_error(capsys, main(_train(good, "ppo.ppo_n_minibatches=1000")))
    assert "ppo.ppo_n_minibatches=1000 is more than a batch's 64 samples" in err


def test_the_python_api_checks_paths_as_the_cli_does(good):
    """``load_config`` leaves paths to where they are used (plan and the Slurm launcher load
    configs whose models exist only on the cluster); ``train`` and ``run_sft`` accepted a
    config without model_path and failed deep in the actor. Now they check first, before
    any process group (none is initialised here)."""
    from areal_mcore.config import load_config
    from areal_mcore.paths import PathError
    from areal_mcore.trainer.ppo import train
    from areal_mcore.trainer.sft import run_sft

    base = [f"dataset.path={good['data']}", f"eval_dataset.path={good['data']}", f"trainer.log_dir={good['logs']}"]
    with pytest.raises(PathError, match=r"^model_path is not set"):
        train(load_config("configs/tiny_cpu.yaml", [*base, "model_path=null"]))
    with pytest.raises(PathError, match=r"^sft.base_model=/nonexistent: "):
        run_sft(load_config("configs/tiny_cpu.yaml", [*base, "sft.base_model=/nonexistent"]))
    assert not dist.is_initialized()
