"""README.md and the docs/ pages: length, links, and the commands in their shell blocks.

Checked here (in-process, no network, no subprocess):
- README.md has at most 150 lines and links every docs/*.md page;
- every relative Markdown link in README.md and docs/*.md points at a file or folder of the
  repository (http(s) and mailto links are ignored), and its #anchor, where it has one into
  a Markdown page, names a heading of that page;
- every backticked repository path in their prose (configs/..., tests/..., areal_mcore/...
  or a path inside areal_mcore/ such as model/attention.py) exists;
- the ```bash / ```sh blocks, command by command: `areal-mcore <subcommand>` (also
  `python -m areal_mcore.cli` and `torchrun ... -m areal_mcore.cli`) names subcommands of
  the parser areal_mcore/cli.py builds, `make <target>` names Makefile targets and its
  VAR=value arguments name variables the Makefile reads, `python -m areal_mcore.x` names a
  module that exists, every repository path on the line exists (scripts/, launch/,
  configs/, tests/, bench/, ...), and `python -m pytest file::test -k word` names a test
  and a word of the files named. A line without placeholders is parsed whole by that CLI
  parser (flags, choices), and its `--config X.yaml key=value ...` loads with
  `load_config` (which only parses and validates: it starts nothing); an
  `sbatch launch/slurm/<script>.sh key=value ...` line loads the script's config with the
  overrides the script adds (launch.allocation, launch.gpus_per_node) and the line's own;
- docs/configs.md: its ```python blocks run (they only load configs) and its error lines
  are the loader's messages, word for word.

Executed: every shell block without a marker, verbatim, in a copy of the repository's
layout (links; `runs/tiny-cpu/assets` built as `make run` builds it). A block that cannot
run in the suite says so in an HTML comment on the line before its fence, invisible on the
rendered page: `<!-- shell: not run: <why> -->` (installs venvs, starts GPU jobs, is the
suite itself, ...), or `<!-- shell: tiny version in tests/x.py::test_y -->`, the test that
runs its flow at tiny size (which must exist). Lines with shell variables ($X), placeholders
(<jobid>, `...`, [optional flags]) or several commands (a pipe) are checked only for their
command names, make targets and paths; an sbatch script with more than one recipe inside
(boba_32b.sh: STAGE picks one, its allocation is computed) is checked for its path only;
`python -m areal_mcore.rollout.embedded.server ...` for its module only (its flags are not the CLI's).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCS = [README, *PAGES]
# Top-level folders whose files the docs name by path (runs/ is a run's output, not the repo's).
REPO_DIRS = ("areal_mcore", "bench", "configs", "docs", "kernels", "launch", "plugins", "scripts",
             "tests", "tools")
# Named in the docs as files that do not exist yet.
NOT_YET = {"bench/results/gpu_check.json"}  # written by the first run of bench/gpu_check.sh
PLACEHOLDER = re.compile(r"\$|<[^>]*>|\.\.\.|\[|\]|…")


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _fenced(text: str):
    """(info string, body) of each fenced code block."""
    for m in re.finditer(r"^[ \t]*```([^\n]*)\n(.*?)^[ \t]*```", text, re.M | re.S):
        yield m.group(1).strip(), m.group(2)


def _prose(text: str) -> str:
    return re.sub(r"^[ \t]*```.*?^[ \t]*```", "", text, flags=re.M | re.S)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --------------------------------------------------------------------------- pages and links

def test_readme_is_at_most_150_lines():
    assert len(_read(README).splitlines()) <= 150


def _links(text: str) -> list[str]:
    prose = re.sub(r"`[^`\n]*`", "", _prose(text))
    return re.findall(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)


def test_every_docs_page_is_linked_from_the_readme():
    assert PAGES, "no docs/*.md pages"
    linked = {(ROOT / t.split("#")[0]).resolve() for t in _links(_read(README))}
    missing = [_rel(p) for p in PAGES if p.resolve() not in linked]
    assert not missing, f"docs pages not linked from README.md: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", _prose(_read(path)), re.M):
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", DOCS, ids=_rel)
def test_relative_links_point_at_files_of_the_repo(page):
    bad = []
    for target in _links(_read(page)):
        if re.match(r"(https?|mailto):", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page.resolve()
        if not dest.exists() or ROOT not in (dest, *dest.parents):
            bad.append(f"{target}: no such file in the repository")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {_rel(dest)}")
    assert not bad, f"{_rel(page)}: " + "; ".join(bad)


def _repo_path(token: str) -> str | None:
    """The repository path a token names (relative to the root), or None if it names none."""
    token = re.sub(r"(::|:\d).*$", "", token.strip("'\",;()"))  # file::test, file:17
    if not token or PLACEHOLDER.search(token) or re.search(r"[*{}|]|step_N|_XXX", token):
        return None
    first = token.split("/")[0]
    if "/" not in token or token.startswith(("/", "~", "http")):
        return None
    if first in REPO_DIRS:
        return token
    # model/attention.py = areal_mcore/model/attention.py (not eval/accuracy, a stats key)
    if first.isidentifier() and (ROOT / "areal_mcore" / first).is_dir() and token.endswith((".py", "/")):
        return f"areal_mcore/{token}"
    return None


@pytest.mark.parametrize("page", DOCS, ids=_rel)
def test_backticked_repository_paths_exist(page):
    missing = []
    for span in re.findall(r"`([^`\n]+)`", _prose(_read(page))):
        for word in span.split():
            path = _repo_path(word.split("=")[-1])
            if path and path not in NOT_YET and not (ROOT / path).exists():
                missing.append(word)
    assert not missing, f"{_rel(page)} names paths that do not exist: {sorted(set(missing))}"


# --------------------------------------------------------------------------- shell blocks

def _shell_lines(page: Path):
    """Each logical line (continuations joined) of the page's bash/sh blocks."""
    for info, body in _fenced(_read(page)):
        if info.split(" ")[0] not in ("bash", "sh", "shell", "console"):
            continue
        for line in re.sub(r"\\\n\s*", " ", body).splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                yield line.strip()


def _commands(line: str) -> list[list[str]]:
    """The line's simple commands as word lists (comments dropped, split at ; && || |)."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    lex.commenters = "#"
    out, cur = [], []
    for tok in lex:
        if tok and set(tok) <= set(";&|"):
            out.append(cur)
            cur = []
        else:
            cur.append(tok)
    return [c for c in [*out, cur] if c]


def _all_shell_lines():
    lines = [(page, line) for page in DOCS for line in _shell_lines(page)]
    assert lines, "no shell blocks found"
    return lines


SHELL_LINES = _all_shell_lines()


class _Built(Exception):
    pass


@pytest.fixture(scope="module")
def cli_parser() -> argparse.ArgumentParser:
    """The parser ``areal_mcore.cli.main`` builds, taken at its parse_args call (nothing runs)."""
    from areal_mcore import cli

    built = {}

    def capture(self, args=None, namespace=None):
        built["parser"] = self
        raise _Built

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture), pytest.raises(_Built):
        cli.main([])
    return built["parser"]


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {name: p for a in parser._actions if isinstance(a, argparse._SubParsersAction)
            for name, p in a.choices.items()}


def _makefile():
    text = re.sub(r"\\\n", " ", _read(ROOT / "Makefile"))
    targets = set()
    for m in re.finditer(r"^([A-Za-z0-9_.%$() -]+?)\s*::?(?!=)", text, re.M):
        targets.update(m.group(1).split())
    return targets, text


def _cli_args(words: list[str]) -> list[str] | None:
    """The arguments after the CLI in `areal-mcore ...` / `python|torchrun ... -m areal_mcore.cli ...`."""
    if Path(words[0]).name == "areal-mcore":
        return words[1:]
    if "-m" in words[:-1] and words[words.index("-m") + 1] == "areal_mcore.cli":
        return words[words.index("-m") + 2:]
    return None


def _env_and_words(words: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


def _parse(parser: argparse.ArgumentParser, args: list[str]) -> argparse.Namespace:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return argparse.ArgumentParser.parse_args(parser, args)
        except SystemExit:
            raise AssertionError(err.getvalue().strip().splitlines()[-1]) from None


def _sbatch_config(script: Path, env: dict[str, str], args: list[str]):
    """(config, overrides) of the launcher the sbatch script runs, or None when the script
    picks among several recipes (its one areal_launch call must be literal)."""
    calls = re.findall(r"^\s*areal_launch\s+(.*)$", _read(script), re.M)
    if len(calls) != 1 or "$" in calls[0].replace('"$@"', ""):
        return None
    words = shlex.split(calls[0])
    config, alloc, extra = words[0], words[1], [w for w in words[2:] if w != "$@"]
    overrides = [f"launch.allocation={env.get('ALLOC', alloc)}",
                 f"launch.gpus_per_node={env.get('GPUS_PER_NODE', '8')}", *extra, *args]
    return env.get("CONFIG", config), overrides


def _check_pytest_args(args: list[str]) -> list[str]:
    """`tests/x.py::test_y` names a test of that file; `-k word` a word in the files named."""
    errors, files = [], []
    for arg in args:
        file, _, test = arg.partition("::")
        if file.endswith(".py") and (ROOT / file).is_file():
            files.append(_read(ROOT / file))
            if test and not re.search(rf"def {re.escape(test.split('[')[0])}\b", files[-1]):
                errors.append(f"{file} has no test {test!r}")
    if "-k" in args[:-1]:
        for word in re.findall(r"\w+", args[args.index("-k") + 1]):
            if word not in ("and", "or", "not") and not any(word in text for text in files):
                errors.append(f"-k {word!r} matches no test in {[a for a in args if a.endswith('.py')]}")
    return errors


def _check_line(line: str, parser, targets, makefile) -> list[str]:
    from areal_mcore.config import load_config

    commands = _commands(line)
    code = " ".join(" ".join(words) for words in commands)
    whole = not PLACEHOLDER.search(code) and len(commands) == 1
    errors = []
    for words in commands:
        env, words = _env_and_words(list(words))
        if not words:
            continue
        for word in [*words, *env.values()]:
            path = _repo_path(word.split("=")[-1])
            if path and not (ROOT / path).exists():
                errors.append(f"{path}: no such file")
        cmd = Path(words[0]).name
        if "-m" in words[:-1]:
            module = words[words.index("-m") + 1]
            base = ROOT.joinpath(*module.split("."))
            if module.startswith("areal_mcore.") and not (
                    base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()):
                errors.append(f"python -m {module}: no such module")
        args = _cli_args(words)
        if args is not None:
            subs, p = _subcommands(parser), parser
            for arg in args:
                if arg.startswith("-") or not subs:
                    break
                if arg not in subs:
                    errors.append(f"areal-mcore has no subcommand {arg!r} here (it has {sorted(subs)})")
                    break
                p = subs[arg]
                subs = _subcommands(p)
            if whole and not errors:
                try:
                    ns = _parse(parser, args)
                    if getattr(ns, "config", None):
                        load_config(ns.config, getattr(ns, "overrides", None) or [])
                except Exception as e:  # noqa: BLE001 - report the parser's/loader's message
                    errors.append(f"{' '.join(args[:2])}: {e}")
        elif cmd == "make":
            for word in words[1:]:
                name, eq, value = word.partition("=")
                if word.startswith("-"):
                    continue
                for var in [name] * bool(eq) + re.findall(r"\$\((\w+)\)", value):
                    if not re.search(rf"\b{re.escape(var)}\b", makefile):
                        errors.append(f"make variable {var} is not in the Makefile")
                if not eq and word not in targets:
                    errors.append(f"make has no target {word!r}")
        elif words[1:3] == ["-m", "pytest"]:
            errors += _check_pytest_args(words[3:])
        elif cmd == "sbatch" and whole:
            scripts = [i for i, w in enumerate(words) if w.endswith(".sh")]
            if scripts and (ROOT / words[scripts[0]]).is_file():
                found = _sbatch_config(ROOT / words[scripts[0]], env, words[scripts[0] + 1:])
                if found:
                    try:
                        load_config(ROOT / found[0], found[1])
                    except Exception as e:  # noqa: BLE001
                        errors.append(f"sbatch {words[scripts[0]]}: {e}")
    return errors


@pytest.mark.parametrize("page", DOCS, ids=_rel)
def test_shell_blocks_name_real_commands_paths_and_configs(page, cli_parser):
    targets, makefile = _makefile()
    bad = []
    for where, line in SHELL_LINES:
        if where == page:
            bad += [f"`{line}`: {e}" for e in _check_line(line, cli_parser, targets, makefile)]
    assert not bad, f"{_rel(page)}:\n" + "\n".join(bad)


SHELL_BLOCK = re.compile(r"(?:^[ \t]*<!-- shell: (?P<mark>.+?) -->[ \t]*\n)?^[ \t]*```(?P<info>[^\n]*)\n(?P<body>.*?)"
                         r"^[ \t]*```", re.M | re.S)


def _shell_blocks(page: Path):
    """(line of the fence, marker or None, body) of each bash/sh block of the page."""
    text = _read(page)
    for m in SHELL_BLOCK.finditer(text):
        if m.group("info").strip().split(" ")[0] in ("bash", "sh", "shell", "console"):
            yield text[:m.start("info")].count("\n") + 1, m.group("mark"), m.group("body")


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """The repository's top-level entries as links, without runs/, where the tiny model
    `make run` builds first is built (a block may plan with it)."""
    from areal_mcore.data.tiny_assets import TinyAssetsConfig, build_tiny_assets

    root = tmp_path_factory.mktemp("docs_sandbox")
    for entry in ROOT.iterdir():
        if entry.name not in ("runs", ".git"):
            (root / entry.name).symlink_to(entry)
    build_tiny_assets(TinyAssetsConfig(out_dir=str(root / "runs" / "tiny-cpu" / "assets"), n_train=8, n_test=2))
    return root


@pytest.mark.parametrize("page", DOCS, ids=_rel)
def test_every_shell_block_runs_here_or_its_marker_says_why(page, sandbox):
    """The documented commands work verbatim: each block runs (bash -euo pipefail, the venv's
    areal-mcore first on PATH), or its marker names the reason or the test of its flow."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    bad = []
    for line, mark, body in _shell_blocks(page):
        where = f"{_rel(page)}:{line}"
        if mark is None:
            out = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=sandbox, env=env, capture_output=True,
                                 text=True, timeout=300)
            if out.returncode:
                bad.append(f"{where}: exit {out.returncode} (mark it `<!-- shell: not run: why -->` if it cannot "
                           f"run in the suite):\n{body}{out.stdout[-1500:]}{out.stderr[-1500:]}")
        elif mark.startswith("tiny version in "):
            file, _, test = mark.removeprefix("tiny version in ").partition("::")
            if not (ROOT / file).is_file() or not re.search(rf"^def {re.escape(test)}\(", _read(ROOT / file), re.M):
                bad.append(f"{where}: {mark!r} names no test")
        elif not (mark.startswith("not run: ") and len(mark) > 20):
            bad.append(f"{where}: marker {mark!r}: expected 'not run: <why>' or 'tiny version in <test id>'")
    assert not bad, "\n".join(bad)


def test_the_checks_see_what_they_check(cli_parser):
    """The helpers find what is there: the CLI's subcommands, the Makefile's targets and
    mistakes of each kind the docs could make."""
    assert {"train", "sft", "eval", "convert", "filter", "plan", "launch"} <= set(_subcommands(cli_parser))
    targets, makefile = _makefile()
    assert {"run", "test", "test-fast"} <= targets
    for wrong in ("areal-mcore trian --config configs/tiny_cpu.yaml",
                  "areal-mcore convert mcore-to-gguf --input a --output b",
                  "areal-mcore train --config configs/tiny_cpu.yaml ppo.eps_clp=0.1",
                  "areal-mcore train --config configs/tiny.yaml",
                  "make tset", "make test TEST_WORKRES=4", "bash scripts/quickstart2.sh",
                  "python -m areal_mcore.rollout.servr --model-path x",
                  "sbatch launch/slurm/boba_7b.sh actor.optimizer.lr=abc",
                  "make test-mcore019 MCORE_TESTS='$(MCORE_TESTS_AL)'",
                  ".venv/bin/python -m pytest tests/test_gae.py -k python_referense",
                  ".venv/bin/python -m pytest tests/test_gae.py::test_no_such_test"):
        assert _check_line(wrong, cli_parser, targets, makefile), wrong
    assert not _check_line("areal-mcore train --config configs/tiny_cpu.yaml trainer.total_steps=5",
                           cli_parser, targets, makefile)
    assert "a-slurm-cluster-on-one-machine" in _anchors(ROOT / "docs" / "slurm.md")
    assert _repo_path("model/attention.py") == "areal_mcore/model/attention.py"
    assert _repo_path("eval/accuracy") is None and _repo_path("runs/<exp>/STOP") is None


# --------------------------------------------------------------------------- config examples

def test_the_python_examples_of_the_configs_page_run(monkeypatch):
    """Its ```python blocks only load configs (nothing starts), so they are executed."""
    monkeypatch.chdir(ROOT)
    blocks = [body for info, body in _fenced(_read(ROOT / "docs" / "configs.md")) if info == "python"]
    assert blocks
    for body in blocks:
        exec(compile(body, "docs/configs.md", "exec"), {})


def test_the_config_errors_shown_are_the_loaders():
    """Each error line on the configs page is what load_config raises for that override."""
    from areal_mcore.config import ConfigError, load_config

    shown = [line for info, body in _fenced(_read(ROOT / "docs" / "configs.md")) if info == "text"
             for line in body.splitlines() if line.strip()]
    assert shown
    for line in shown:
        m = re.match(r"override '([^']+)'", line) or re.match(r"([\w.]+)='?([^' ]+)'? ", line)
        override = m.group(1) if m.lastindex == 1 else f"{m.group(1)}={m.group(2)}"
        with pytest.raises(ConfigError) as e:
            load_config(ROOT / "configs" / "boba_7b.yaml", [override])
        assert str(e.value) == line
