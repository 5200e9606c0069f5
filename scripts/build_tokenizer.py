#!/usr/bin/env python3
"""Train the tiny byte-level BPE tokenizer on a boba-format JSONL and save it (offline).

    python scripts/build_tokenizer.py --data data/synthetic.jsonl --out assets/tokenizer --vocab-size 512
"""

import argparse
import json

from areal_mcore.data.tokenizer import build_tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="boba-format JSONL (prompt, solutions)")
    p.add_argument("--out", required=True, help="folder for AutoTokenizer.from_pretrained")
    p.add_argument("--vocab-size", type=int, default=512)
    a = p.parse_args()
    texts = []
    with open(a.data) as f:
        for line in f:
            row = json.loads(line)
            texts += [row["prompt"], *row["solutions"]]
    build_tokenizer(texts, a.vocab_size).save_pretrained(a.out)
    print(f"saved a {a.vocab_size}-token byte-level BPE tokenizer to {a.out}")


if __name__ == "__main__":
    main()
