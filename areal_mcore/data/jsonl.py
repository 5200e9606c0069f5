"""Load math problems from JSONL with row-level errors that name ``file:line``.

Formats (``DatasetConfig.format``):
- ``boba``: ``{"prompt": str, "solutions": [str, ...]}`` (AReaL boba's release format);
- ``qa``: ``{"question": str, "answer": str}`` (one solution);
- ``messages``: ``{"messages": [{"role", "content"}, ...], "solutions": [...]}``, the
  prompt being the chat so far;
- ``mc`` (multiple choice, e.g. GPQA): ``{"question": str, "choices": [str, ...],
  "answer": "B" or 1}``; the gold solution is the option's letter, and prompts list the
  options as ``A) ...`` (``data.prompts.render_choices``).
The key names are configurable (defaults per format in ``FORMAT_KEYS``). A bad row
(invalid JSON, not UTF-8, missing or empty field) raises ``DatasetError`` naming the file
and line, or with ``skip_bad_rows`` is skipped and counted in the returned report.

``path`` may also be a JSON or Parquet file, a folder of JSONL/JSON/Parquet files, a
``datasets.save_to_disk`` folder or a hub dataset id (``split`` picks the split); those
rows come through ``datasets`` (``data.sources``) and are checked by the same code, their
errors naming ``file row N`` (1-based). JSONL files are read here line by line, so errors
can name bytes that are no valid UTF-8 and the filters can copy rows byte for byte.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from areal_mcore.checks import check_choice

FORMATS = ("boba", "qa", "messages", "mc")
# (prompt_key, solutions_key) when the config leaves them unset.
FORMAT_KEYS = {"boba": ("prompt", "solutions"), "qa": ("question", "answer"),
               "messages": ("messages", "solutions"), "mc": ("question", "answer")}
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"  # multiple-choice option labels
THINK_MODES = ("auto", "always", "never")


class DatasetError(ValueError):
    """A dataset row the user must fix; the message starts with ``file:line``."""


@dataclass(kw_only=True)
class DatasetConfig:
    path: str
    format: str = "boba"
    prompt_key: str | None = None  # None: FORMAT_KEYS[format]
    solutions_key: str | None = None  # a single string for qa, a letter or index for mc
    choices_key: str = "choices"  # mc only
    skip_bad_rows: bool = False
    split: str = "train"  # for hub ids and saved dataset dicts
    # Appended to each question on its own line, in training and eval alike
    # (data.prompts.prompts_for). "auto": boba's instruction (BOBA_SUFFIX) where the
    # question does not already ask for a \boxed{} answer (AIME/MATH-style qa and mc rows),
    # nothing where it does (boba's release rows, the synthetic task); "" for none.
    # Chat-format (messages) rows are used as written.
    instruction: str = "auto"
    # Responses start with "<think>\n": auto = where the chat template has thinking (R1
    # and Qwen3 style), always, or never.
    think: str = "auto"

    def __post_init__(self):
        check_choice("format", self.format, FORMATS)
        check_choice("think", self.think, THINK_MODES)
        prompt_key, solutions_key = FORMAT_KEYS[self.format]
        self.prompt_key = self.prompt_key or prompt_key
        self.solutions_key = self.solutions_key or solutions_key


@dataclass(frozen=True)
class Problem:
    prompt: str | tuple[tuple[str, str], ...]  # text, or (role, content) messages
    solutions: tuple[str, ...]
    source: str  # file:line
    choices: tuple[str, ...] = ()  # mc: the options; solutions hold the gold letter
    # The row's other columns, for reward.fn's **fields (see ``row_fields``).
    fields: dict = field(default_factory=dict, hash=False, compare=False)


# reward.fn's own arguments (reward/fn.py): a column of one of these names is not passed on.
RESERVED_FIELDS = frozenset({"prompt", "completion", "prompt_ids", "completion_ids", "solutions", "source",
                             "timeout_s"})


def row_fields(row: dict, used: set[str]) -> dict:
    """The row's columns the format did not read, as JSON values (they travel to the reward
    workers as JSON): a value JSON cannot hold (a date from Parquet, say) is passed as its
    ``str``; columns named like reward.fn's own arguments are left out."""
    out = {}
    for key, value in row.items():
        if key in used or key in RESERVED_FIELDS or not isinstance(key, str):
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            value = str(value)
        out[key] = value
    return out


@dataclass
class LoadReport:
    rows: int = 0
    bad_rows: list[str] = field(default_factory=list)  # "file:line: why"


def load_problems(cfg: DatasetConfig) -> tuple[list[Problem], LoadReport]:
    """Every good row of ``cfg.path``; raises on the first bad one unless skipping."""
    from areal_mcore.data.sources import dataset_rows

    problems, report = [], LoadReport()
    for where, raw in dataset_rows(cfg.path, cfg.split, jsonl_lines):
        report.rows += 1
        try:
            problems.append(_parse(raw, cfg, where) if isinstance(raw, bytes) else _parse_row(raw, cfg, where))
        except DatasetError as e:
            if not cfg.skip_bad_rows:
                raise
            report.bad_rows.append(str(e))
    if report.bad_rows:  # said where it happens, whoever called (training, SFT, eval, filters)
        shown = report.bad_rows[:20]
        more = f"\n  ... and {len(report.bad_rows) - len(shown)} more" if len(report.bad_rows) > len(shown) else ""
        print(f"[data] skipped {len(report.bad_rows)} bad row(s) of {report.rows} in {cfg.path} "
              f"(dataset.skip_bad_rows=true):\n  " + "\n  ".join(shown) + more, file=sys.stderr, flush=True)
    return problems, report


def jsonl_lines(path: Path):
    """(``file:line``, raw bytes) of every non-blank line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if raw.strip():
                yield f"{path}:{lineno}", raw


def _parse(raw: bytes, cfg: DatasetConfig, where: str) -> Problem:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{where}: not valid UTF-8 (byte {e.start})") from None
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    return _parse_row(row, cfg, where)


def _parse_row(row, cfg: DatasetConfig, where: str) -> Problem:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    prompt = _field(row, cfg.prompt_key, where)
    solutions = _field(row, cfg.solutions_key, where)
    choices = ()
    if cfg.format == "mc":
        choices = _choices(_field(row, cfg.choices_key, where), cfg.choices_key, where)
        solutions = [_gold_letter(solutions, len(choices), cfg.solutions_key, where)]
    elif cfg.format == "qa":
        solutions = [solutions]
    if not isinstance(solutions, list) or not solutions or not all(
            isinstance(s, str) and s.strip() for s in solutions):
        raise DatasetError(f"{where}: {cfg.solutions_key!r} must be a non-empty list of non-empty strings")
    if cfg.format == "messages":
        if not isinstance(prompt, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt):
            raise DatasetError(f"{where}: {cfg.prompt_key!r} must be a list of {{role, content}} messages")
        prompt = tuple((m["role"], m["content"]) for m in prompt)
    elif not isinstance(prompt, str) or not prompt.strip():
        raise DatasetError(f"{where}: {cfg.prompt_key!r} must be a non-empty string")
    used = {cfg.prompt_key, cfg.solutions_key} | ({cfg.choices_key} if cfg.format == "mc" else set())
    return Problem(prompt=prompt, solutions=tuple(solutions), source=where, choices=choices,
                   fields=row_fields(row, used))


def _choices(value, key: str, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not 2 <= len(value) <= len(LETTERS) or not all(
            isinstance(c, str) and c.strip() for c in value):
        raise DatasetError(f"{where}: {key!r} must be a list of 2 to {len(LETTERS)} non-empty strings")
    return tuple(value)


def _gold_letter(answer, n_choices: int, key: str, where: str) -> str:
    """The gold option as a letter, from a letter ('B') or a 0-based index (1)."""
    letters = LETTERS[:n_choices]
    if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < n_choices:
        return letters[answer]
    if isinstance(answer, str) and answer.strip() and answer.strip().upper() in letters:
        return answer.strip().upper()
    raise DatasetError(f"{where}: {key!r} must be one of the letters {list(letters)} or a 0-based "
                       f"index below {n_choices}, got {answer!r}")


def _field(row: dict, key: str, where: str):
    if key not in row:
        raise DatasetError(f"{where}: missing field {key!r} (row has {sorted(row)})")
    return row[key]
