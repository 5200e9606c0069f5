"""The package's import graph: no cycles, and the layering rules of docs/layout.md.

The graph is read from the source (ast), with function-local imports included: a cycle
held off only by an import inside a function breaks as soon as someone hoists it. Imports
under ``if TYPE_CHECKING:`` are left out: they never run, and annotations name types that
way precisely so that a module can refer to its caller's types without importing it. One
test counts them all the same: a circle of types is still one for the reader. What a
module pulls in *when imported* (the megatron rules) follows module-level imports only.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "areal_mcore"


def import_graph(package_dir: Path, name: str, *, type_only: bool = False) -> dict[str, dict[str, set[str]]]:
    """``{module: {"all": modules it imports, "top": those imported at module level,
    "external": top-level third-party names imported at module level}}``, within ``name``;
    ``type_only``: with the imports under ``if TYPE_CHECKING:`` too."""
    files = {}
    for path in package_dir.rglob("*.py"):
        parts = list(path.relative_to(package_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join([name, *parts])] = path
    graph = {}
    for module, path in files.items():
        is_pkg = path.name == "__init__.py"
        edges = {"all": set(), "top": set(), "external": set()}
        tree = ast.parse(path.read_text())
        if not type_only:
            _drop_type_checking_blocks(tree)
        top_level = {id(n) for n in _module_level(tree)}
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    pkg = module.split(".") if is_pkg else module.split(".")[:-1]
                    base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
                # `from pkg import sub` imports the submodule when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                if target.split(".")[0] == name:
                    edges["all"].add(target)
                    if id(node) in top_level:
                        edges["top"].add(target)
                elif id(node) in top_level:
                    edges["external"].add(target.split(".")[0])
        graph[module] = edges
    return graph


def _drop_type_checking_blocks(tree: ast.Module) -> None:
    for node in ast.walk(tree):
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Name | ast.Attribute)
                and ast.unparse(node.test).split(".")[-1] == "TYPE_CHECKING"):
            node.body = []


def _module_level(tree: ast.Module):
    """Statements run at import: the module body and the branches of its if/try blocks."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If | ast.Try | ast.With):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(getattr(node, field, []))
        if isinstance(node, ast.ExceptHandler):
            todo.extend(node.body)


def find_cycle(graph: dict[str, dict[str, set[str]]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None (depth-first search, all imports)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for nxt in sorted(graph[module]["all"]):
            if nxt not in graph or nxt == module:
                continue
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def reachable_at_import(graph, module: str) -> set[str]:
    """Every package module that importing ``module`` executes (module-level imports;
    importing ``a.b.c`` runs ``a`` and ``a.b`` first)."""
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m in seen or m not in graph:
            continue
        seen.add(m)
        parts = m.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(graph[m]["top"])
    return seen


GRAPH = import_graph(PACKAGE, "areal_mcore")


def _in(module: str, *packages: str) -> bool:
    return any(module == f"areal_mcore.{p}" or module.startswith(f"areal_mcore.{p}.") for p in packages)


def test_the_cycle_finder_reports_a_cycle_planted_in_a_synthetic_package(tmp_path):
    pkg = tmp_path / "planted"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "config.py").write_text("from planted.sub.actor import Actor\n")
    # the cycle closes through a function-local import, as config -> ... -> actor did
    (pkg / "sub" / "actor.py").write_text("class Actor:\n    def f(self):\n        from planted import config\n")
    (pkg / "leaf.py").write_text("import os\n")
    graph = import_graph(pkg, "planted")
    assert find_cycle(graph) == ["planted.config", "planted.sub.actor", "planted.config"]
    # a type-only import never runs: no cycle; the same import in the else branch runs: a cycle
    guarded = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from planted import config\n"
    (pkg / "sub" / "actor.py").write_text(guarded)
    assert find_cycle(import_graph(pkg, "planted")) is None
    (pkg / "sub" / "actor.py").write_text(guarded + "else:\n    from planted import config\n")
    assert find_cycle(import_graph(pkg, "planted")) == ["planted.config", "planted.sub.actor", "planted.config"]


def test_the_package_has_no_import_cycle():
    assert len(GRAPH) > 50  # the walk found the package
    assert find_cycle(GRAPH) is None, f"import cycle: {' -> '.join(find_cycle(GRAPH))}"


def test_no_cycle_either_counting_the_imports_made_for_types_only():
    """A circle drawn through ``TYPE_CHECKING`` imports never runs, but a reader still has
    to hold all of it at once (client -> engines -> client was one, until the adapters
    took the ``Fleet`` interface and the server config moved to a leaf)."""
    graph = import_graph(PACKAGE, "areal_mcore", type_only=True)
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_no_engine_adapter_imports_the_client_and_the_syncer_sees_servers_only_through_the_fleet():
    graph = import_graph(PACKAGE, "areal_mcore", type_only=True)
    adapters = [m for m in graph if _in(m, "rollout.engines")]
    assert len(adapters) >= 4
    assert not {m for m in adapters if "areal_mcore.rollout.client" in graph[m]["all"]}
    syncers = [m for m in graph if _in(m, "weight_sync")]
    assert len(syncers) >= 5
    assert not {m for m in syncers if "areal_mcore.rollout.client" in graph[m]["all"]}


# Above the schema: the CLI, the launcher and the loops they start with a loaded config.
ABOVE_CONFIG = {"areal_mcore.cli", "areal_mcore.trainer.ppo", "areal_mcore.trainer.sft"}


def test_nothing_below_the_root_schema_imports_config():
    importers = {m for m, e in GRAPH.items() if "areal_mcore.config" in e["all"]}
    below = {m for m in importers if not (m in ABOVE_CONFIG or _in(m, "launcher"))}
    assert importers and not below, f"{sorted(below)} import areal_mcore.config (only cli, launcher/ and the loops may)"
    # and the schema reaches none of them
    assert not {m for m in reachable_at_import(GRAPH, "areal_mcore.config") if m in ABOVE_CONFIG or _in(m, "launcher.slurm")}


def test_only_cli_launcher_and_the_schema_import_the_trainer():
    bad = {(m, t) for m, e in GRAPH.items() for t in e["all"]
           if _in(t, "trainer") and not (_in(m, "trainer", "launcher") or m in ("areal_mcore.cli", "areal_mcore.config"))}
    assert not bad, f"imports of trainer/ from below it: {sorted(bad)}"
    # the schema takes the trainer's config modules only, never the loop
    schema = {t for t in GRAPH["areal_mcore.config"]["all"] if _in(t, "trainer")}
    assert schema <= {"areal_mcore.trainer.config", "areal_mcore.trainer.wandb_log"}, schema


@pytest.mark.parametrize("leaf", ["algo", "packing", "kernels"])
def test_tensor_packages_are_leaves(leaf):
    # Leaves may use each other and the package's top-level helper modules (collectives,
    # checks, ...), which import nothing from areal_mcore themselves.
    helpers = {m for m, e in GRAPH.items() if m.count(".") == 1 and not e["all"]
               and not (PACKAGE / m.split(".")[1]).is_dir()}
    assert "areal_mcore.checks" in helpers and "areal_mcore.net" in helpers
    bad = {(m, t) for m, e in GRAPH.items() if _in(m, leaf) for t in e["all"]
           if not (_in(t, "algo", "packing", "kernels") or t in helpers or t == "areal_mcore")}
    assert not bad, f"{leaf}/ imports above the leaves: {sorted(bad)}"


def test_model_never_imports_the_actor_or_the_trainer():
    bad = {(m, t) for m, e in GRAPH.items() if _in(m, "model") for t in e["all"] if _in(t, "actor", "trainer")}
    assert not bad, sorted(bad)


@pytest.mark.parametrize("side", ["rollout", "reward", "launcher"])
def test_the_inference_side_and_the_launcher_start_without_the_training_stack(side):
    for module in [m for m in GRAPH if _in(m, side)]:
        runs = reachable_at_import(GRAPH, module)
        actor = {m for m in runs if _in(m, "actor") and m not in ("areal_mcore.actor", "areal_mcore.actor.config")}
        megatron = {m for m in runs if "megatron" in GRAPH[m]["external"]}
        assert not actor and not megatron, f"importing {module} runs {sorted(actor | megatron)}"


def test_only_weight_sync_and_the_orchestrators_know_both_actor_and_rollout():
    both = {m.split(".")[1] for m, e in GRAPH.items()
            if any(_in(t, "actor") and t != "areal_mcore.actor.config" for t in e["all"])
            and any(_in(t, "rollout") for t in e["all"])}
    assert both <= {"weight_sync", "trainer", "cli"}, both


def test_the_actor_imports_neither_the_rollout_side_nor_aiohttp():
    code = ("import sys, areal_mcore.actor, areal_mcore.actor.megatron_actor, areal_mcore.actor.checkpoint\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'aiohttp'"
            " or m.startswith(('areal_mcore.rollout', 'areal_mcore.reward', 'areal_mcore.config'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_no_two_modules_or_packages_share_a_name():
    """A name says where to look: ``rollout/launcher.py`` beside ``launcher/`` and
    ``weight_sync/plan.py`` beside ``plan/`` sent readers to the wrong one. Each
    component's ``config.py`` (its config dataclass, beside it: docs/layout.md) is the one
    shared name."""
    names: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*"):
        if "__pycache__" in path.parts or path.name in ("__init__.py", "config.py"):
            continue
        if path.suffix == ".py" or (path.is_dir() and (path / "__init__.py").exists()):
            names.setdefault(path.stem, []).append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert not shared, shared
