"""Reads the history of an offline W&B run back from its ``run-<id>.wandb`` file.

wandb 0.31 ships no reader of its transaction log, so this follows the format its
writer uses (LevelDB's log format, W&B header): a 7-byte file header ``:W&B`` + magic
0xBEE1 + version 0, then 32 KiB blocks of records, each a 7-byte header (crc32, length,
type FULL=1 | FIRST=2 | MIDDLE=3 | LAST=4) and a chunk; chunks join into serialized
``wandb_internal_pb2.Record`` messages.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = b":W&B\xe1\xbe\x00"


def records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:7] == HEADER, f"{path}: not a W&B transaction log"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block trailer: padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf + chunk if kind == 4 else chunk)
            buf = b""
            yield record
        else:
            buf = chunk if kind == 2 else buf + chunk


def history(run_dir: Path) -> tuple[list[str], list[dict]]:
    """(the run id of every offline run file under run_dir/wandb in start order, every
    history row of them in order as {key: value}, ``_step`` included)."""
    ids, rows = [], []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for r in records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                ids.append(r.run.run_id)
            elif kind == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    return ids, rows
