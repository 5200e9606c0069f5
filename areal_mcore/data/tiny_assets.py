"""Everything the tiny CPU run needs, built offline: synthetic train/test problems, a
byte-level BPE tokenizer trained on them, and a random Qwen2-architecture model sized
to that tokenizer, saved as an HF folder (weights + config + tokenizer).

``--task tool`` builds the tiny tool task's instead (``configs/tiny_tool_cpu.yaml``):
two-by-two-digit multiplication, a ``lead`` column with a calculator call on a fraction
of the rows (the SFT warm-up's demonstrations), and the tool-call markers added to the
tokenizer as single tokens (``rollout/episodes/tool_use.py`` needs them atomic)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from areal_mcore.data.synthetic import generate, write_jsonl
from areal_mcore.data.tokenizer import build_tokenizer


@dataclass(kw_only=True)
class TinyAssetsConfig:
    out_dir: str
    n_train: int = 2000
    n_test: int = 200
    levels: tuple[int, ...] = (0,)
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    seed: int = 0
    tool_demos: float | None = None  # the tool task: this fraction of rows lead with a call
    markers: tuple[str, ...] = ()  # added to the tokenizer as single (non-special) tokens


TOOL_MARKERS = ("<calc>", "</calc>", "<out>", "</out>")


def tool_task(out_dir: str, seed: int = 0) -> TinyAssetsConfig:
    """The tiny tool task's assets: a fifth of the SFT rows demonstrate the calculator."""
    return TinyAssetsConfig(out_dir=out_dir, seed=seed, levels=(4,), tool_demos=0.2, markers=TOOL_MARKERS)


def build_tiny_assets(cfg: TinyAssetsConfig) -> dict[str, str]:
    """Writes ``train.jsonl``, ``test.jsonl`` and ``model/`` under ``cfg.out_dir``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train = generate(cfg.n_train, seed=cfg.seed, levels=cfg.levels, tool_demos=cfg.tool_demos)
    test = generate(cfg.n_test, seed=cfg.seed + 10_000, levels=cfg.levels, tool_demos=cfg.tool_demos)
    write_jsonl(train, out / "train.jsonl")
    write_jsonl(test, out / "test.jsonl")
    texts = [r["prompt"] for r in train] + [f"{r.get('lead', '')}The answer is {s}." for r in train
                                            for s in r["solutions"]]
    tok = build_tokenizer(texts, cfg.vocab_size)
    tok.add_tokens(list(cfg.markers))
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=1024, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
        use_sliding_window=False)
    torch.manual_seed(cfg.seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out / "model")
    tok.save_pretrained(out / "model")
    return {"train": str(out / "train.jsonl"), "test": str(out / "test.jsonl"), "model": str(out / "model")}


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for train.jsonl, test.jsonl and model/")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task", choices=("boba", "tool"), default="boba",
                   help="boba: one-digit addition (make run); tool: multiplication with a calculator (make run-tool)")
    a = p.parse_args(argv)
    cfg = tool_task(a.out, a.seed) if a.task == "tool" else TinyAssetsConfig(out_dir=a.out, seed=a.seed)
    paths = build_tiny_assets(cfg)
    print("built " + ", ".join(f"{k}: {v}" for k, v in paths.items()))


if __name__ == "__main__":
    main()
