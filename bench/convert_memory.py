"""Peak memory of ``mcore_to_hf`` on a ~200M-parameter model vs the model's size.

Builds a random Qwen2 (hidden 1024, 16 layers, 32k vocab, untied: ~270M parameters,
~1 GiB in fp32), imports it as a checkpoint, then exports it in a fresh process and
reads that process's peak RSS; a process that only imports the same modules gives the
baseline. Run: ``python bench/convert_memory.py`` (a few minutes, ~5 GB of RAM and disk).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "convert_memory.json"
ROOT = Path(__file__).parents[1]

# VmHWM (peak RSS of this address space) resets at exec; ru_maxrss would not, and would
# count the parent's pages shared at fork.
_PEAK = ("{body}; print(next(int(line.split()[1]) * 1024 for line in open('/proc/self/status') "
         "if line.startswith('VmHWM')))")


def _peak_rss(body: str) -> int:
    """Peak RSS in bytes of a fresh interpreter running ``body``."""
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", _PEAK.format(body=body)], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def main(out: Path = RESULTS) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from areal_mcore.convert.tools import hf_to_mcore

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        config = Qwen2Config(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                             num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False)
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp / "hf", max_shard_size="500MB")
        del model
        t0 = time.perf_counter()
        ckpt = hf_to_mcore(tmp / "hf", tmp / "ckpt")
        import_s = time.perf_counter() - t0
        imports = "from areal_mcore.convert.tools import mcore_to_hf"
        baseline = _peak_rss(imports)
        t0 = time.perf_counter()
        peak = _peak_rss(f"{imports}; mcore_to_hf({str(ckpt)!r}, {str(tmp / 'out')!r}, "
                         f"max_shard_bytes=256 << 20, progress=False)")
        export_s = time.perf_counter() - t0
    row = {
        "parameters": n_params, "model_bytes_fp32": 4 * n_params,
        "largest_tensor_bytes": 4 * 32000 * 1024, "shard_bytes": 256 << 20,
        "export_peak_rss": peak, "import_only_rss": baseline, "export_extra_rss": peak - baseline,
        "export_s": export_s, "import_s": import_s,
    }
    gib = 2**30
    print(f"model: {n_params / 1e6:.0f}M parameters, {row['model_bytes_fp32'] / gib:.2f} GiB fp32")
    print(f"mcore_to_hf peak RSS {peak / gib:.2f} GiB; the same imports alone {baseline / gib:.2f} GiB; "
          f"extra {row['export_extra_rss'] / gib:.2f} GiB = "
          f"{row['export_extra_rss'] / row['model_bytes_fp32']:.0%} of the model "
          f"(shard 0.25 GiB, largest tensor {row['largest_tensor_bytes'] / gib:.2f} GiB)")
    print(f"export {export_s:.1f}s, import {import_s:.1f}s")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row, indent=1))
    return row


if __name__ == "__main__":
    main()
