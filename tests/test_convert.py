"""HF <-> megatron checkpoint conversion through the real CLI (subprocesses)."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _tiny_model import tiny_qwen2
from safetensors.torch import save_file

from areal_mcore.cli import parse_size
from areal_mcore.convert.tools import load_hf_state_dict
from areal_mcore.model.adapter import WeightMismatchError

ROOT = Path(__file__).parents[1]


def _cli(*args, check=True, quiet=True):
    proc = subprocess.run([sys.executable, *(["-W", "ignore"] if quiet else []), "-m", "areal_mcore.cli", "convert",
                           *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    if check and proc.returncode:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("hf")
    _, state, model = tiny_qwen2(vocab=250)
    model.save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(249)} | {"<unk>": 249}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(folder)
    return folder, state, model


def _import_export(hf, tmp, tp, pp, *extra):
    ckpt, out = tmp / f"ckpt_tp{tp}pp{pp}", tmp / f"hf_tp{tp}pp{pp}"
    # As a user runs it (Python's default warning filters): no screen of megatron-core's
    # start-up warnings from the spawned ranks (14 of them), only our one-line summary.
    proc = _cli("hf-to-mcore", "--input", str(hf), "--output", str(ckpt), "--tp", str(tp), "--pp", str(pp),
                quiet=False)
    assert "Warning" not in proc.stderr, proc.stderr
    _cli("mcore-to-hf", "--input", str(ckpt), "--output", str(out), "--no-progress", *extra)
    return ckpt, out


@pytest.mark.slow
def test_hf_to_tp2_pp2_to_hf_is_bitwise_and_loads_offline(hf_folder, tmp_path):
    from transformers import AutoModelForCausalLM

    hf, state, model = hf_folder
    _, out = _import_export(hf, tmp_path, 2, 2, "--verify", "--max-shard-size", "150KB",
                            "--tokenizer", str(hf))
    back = load_hf_state_dict(out)
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    for name in ("config.json", "generation_config.json"):
        assert (out / name).exists()
    from transformers import AutoTokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):  # carried over unchanged
        assert (out / name).read_bytes() == (hf / name).read_bytes()
    text = "w3 w7 w250"
    assert AutoTokenizer.from_pretrained(str(out)).encode(text) == AutoTokenizer.from_pretrained(str(hf)).encode(text)
    loaded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True,
                                                  attn_implementation="eager").eval()  # as the original
    tokens = torch.randint(0, 250, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


@pytest.mark.slow
def test_config_mismatch_lists_every_field_and_writes_nothing(hf_folder, tmp_path):
    hf, _, _ = hf_folder
    ckpt = tmp_path / "ckpt"
    _cli("hf-to-mcore", "--input", str(hf), "--output", str(ckpt))
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((hf / "config.json").read_text())
    config.update(hidden_size=128, num_key_value_heads=4)
    config["rope_parameters"]["rope_theta"] = 1e6  # transformers >= 5 keeps RoPE here
    (other / "config.json").write_text(json.dumps(config))
    proc = _cli("mcore-to-hf", "--input", str(ckpt), "--output", str(tmp_path / "out"),
                "--hf-config", str(other), check=False)
    assert proc.returncode == 2
    for field in ("hidden_size: checkpoint 64 vs HF config 128", "num_kv_heads: checkpoint 2 vs HF config 4",
                  "rope_theta: checkpoint 10000.0 vs HF config 1000000.0"):
        assert field in proc.stderr
    assert not (tmp_path / "out").exists()
    # An export no tokenizer is found for (the imported folder lost its tokenizer) is
    # refused before writing, naming the flags; it wrote a folder AutoTokenizer read as empty.
    manifest = json.loads((ckpt / "step_00000000" / "manifest.json").read_text())
    assert manifest["config"] == {"imported_from": str(hf)} and manifest["weights_only"]
    manifest["config"]["imported_from"] = str(other)
    (ckpt / "step_00000000" / "manifest.json").write_text(json.dumps(manifest))
    proc = _cli("mcore-to-hf", "--input", str(ckpt), "--output", str(tmp_path / "out"), check=False)
    assert proc.returncode == 2 and "Pass --tokenizer DIR" in proc.stderr and "--no-tokenizer" in proc.stderr, \
        proc.stderr
    assert not (tmp_path / "out").exists()
    # A checkpoint holding tensors the model args do not explain is refused, listing them.
    from areal_mcore.convert.mcore_reader import McoreCheckpointReader

    reader = McoreCheckpointReader.resolve(ckpt)
    reader.args = dataclasses.replace(reader.args, qkv_bias=False)
    with pytest.raises(WeightMismatchError, match=r"unexpected tensors \['decoder.layers.self_attention.linear_qkv.bias'\]"):
        reader.check_keys()


def test_missing_and_extra_hf_tensors_are_listed(hf_folder, tmp_path):
    hf, state, _ = hf_folder
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((hf / "config.json").read_text())
    tensors = dict(state)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.9.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(bad / "model.safetensors"))
    proc = _cli("hf-to-mcore", "--input", str(bad), "--output", str(tmp_path / "ckpt"), check=False)
    assert proc.returncode == 2
    assert "model.layers.1.mlp.up_proj.weight" in proc.stderr
    assert "model.layers.9.mlp.extra.weight" in proc.stderr


def test_size_parser():
    assert parse_size("2GB") == 2_000_000_000 and parse_size("64KiB") == 65536
    assert parse_size("1048576") == 1048576
    with pytest.raises(Exception, match="not a size"):
        parse_size("big")


def test_help_explains_both_directions(capsys):
    import areal_mcore.cli as cli

    def help_of(*args):
        with pytest.raises(SystemExit) as done:  # argparse prints the help and exits 0
            cli.main(["convert", *args, "--help"])
        assert done.value.code == 0
        return capsys.readouterr().out
    out = help_of()
    assert "mcore-to-hf" in out and "hf-to-mcore" in out
    assert "Streams one layer at a time" in help_of("mcore-to-hf")
