"""Where dataset rows come from: JSONL read line by line, everything else through ``datasets``.

``dataset_rows(path, split, jsonl_lines)`` yields ``(where, row)`` for one ``dataset.path``:
- a ``.jsonl`` file: ``jsonl_lines(file)``, raw bytes per line (``file:line``);
- a ``.json`` (JSON lines or one array) or ``.parquet`` file:
  ``datasets.load_dataset("json" | "parquet", data_files=file)``, dict rows (``file row N``);
- a folder: every JSONL/JSON/Parquet file below it in sorted order, each as above, or a
  ``datasets.save_to_disk`` folder (``datasets.load_from_disk``, ``split`` for a dict);
- a hub dataset id (``inclusionAI/AReaL-boba-Data``): ``datasets.load_dataset(id, split=split)``,
  which reads its local cache offline (``HF_HUB_OFFLINE=1``) and the hub otherwise.
Rows from every source then go through the same checks (``data.jsonl``), so a bad Parquet
row is reported as ``file.parquet row 3: missing field 'prompt'``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from areal_mcore.paths import DATA_SUFFIXES, data_files, is_hub_id

BUILDERS = {".json": "json", ".parquet": "parquet"}
SAVED_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")


def dataset_rows(path: str, split: str, jsonl_lines: Callable[[Path], Iterator]) -> Iterator[tuple[str, object]]:
    """(where, raw JSONL bytes or a row dict) for every row of ``path`` (see module doc)."""
    p = Path(path)
    if p.is_file():
        yield from _file_rows(p, jsonl_lines)
    elif p.is_dir():
        if any((p / m).is_file() for m in SAVED_MARKERS):
            yield from _saved_rows(p, split)
            return
        files = [f for f in data_files(p) if f.suffix.lower() in DATA_SUFFIXES]
        if not files:
            raise FileNotFoundError(f"dataset folder {p} holds no {'/'.join(DATA_SUFFIXES)} file and is no "
                                    "datasets.save_to_disk folder")
        for f in files:
            yield from _file_rows(f, jsonl_lines)
    elif is_hub_id(path):
        yield from _numbered(f"{path}[{split}]", _load("load_dataset", path, split=split))
    else:
        raise FileNotFoundError(f"dataset not found: {path} (a JSONL/JSON/Parquet file, a folder of them, "
                                "or a hub dataset id owner/name)")


def _file_rows(f: Path, jsonl_lines) -> Iterator[tuple[str, object]]:
    suffix = f.suffix.lower()
    if suffix == ".jsonl":
        yield from jsonl_lines(f)
    elif suffix in BUILDERS:
        yield from _numbered(str(f), _load("load_dataset", BUILDERS[suffix], data_files=str(f), split="train"))
    else:
        raise FileNotFoundError(f"dataset file {f}: {suffix or 'no'} extension; expected one of {DATA_SUFFIXES}")


def _saved_rows(folder: Path, split: str) -> Iterator[tuple[str, object]]:
    ds = _load("load_from_disk", str(folder))
    if hasattr(ds, "keys"):  # a DatasetDict
        if split not in ds:
            raise ValueError(f"dataset {folder} has splits {sorted(ds)}, not split={split!r}: set dataset.split")
        ds, where = ds[split], f"{folder}[{split}]"
    else:
        where = str(folder)
    yield from _numbered(where, ds)


def _numbered(where: str, rows) -> Iterator[tuple[str, object]]:
    for i, row in enumerate(rows, 1):
        yield f"{where} row {i}", row


def _load(fn: str, *args, **kwargs):
    """``datasets.<fn>(...)``, with its import and loading errors as one line naming the source."""
    name = kwargs.get("data_files") or args[0]
    try:
        import datasets
    except ImportError:
        raise ValueError(f"reading dataset {name} needs the `datasets` package: pip install datasets "
                         "(a dependency of areal-mcore: reinstall it)") from None
    try:
        return getattr(datasets, fn)(*args, **kwargs)
    except (FileNotFoundError, ValueError, OSError) as e:
        # The hub's and the builders' errors are long and multi-line; keep the first line.
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FileNotFoundError(f"dataset {name}: cannot load it with datasets.{fn}: {first}") from None
    except Exception as e:  # pyarrow's and the JSON builder's parse errors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"dataset {name}: datasets.{fn} failed: {type(e).__name__}: {first}") from None
