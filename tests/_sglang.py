"""SGLang's own code, loaded from its wheels, for the contract tests.

SGLang does not run here (its wheel needs CUDA packages), and importing its packages
runs ``__init__`` files that reach ``sgl_kernel``/``tvm_ffi``. But the parts that decide
whether our requests and our weight-update group are right are plain Python:

- whole modules whose imports are light (``sampling/sampling_params.py``,
  ``weight_sync/tensor_bucket.py``, ``api/v1/api_types.py``) are imported from the wheel
  file through ``wheel_modules`` - a finder that serves ``sglang.*`` straight from the zip
  and gives every package an empty module instead of running its ``__init__``;
- single definitions inside heavy modules (``init_custom_process_group`` in
  ``srt/utils/common.py``, the request structs in ``srt/managers/io_struct.py``) are cut
  out of the wheel's source with ``ast`` and executed in a module of their own.

Nothing of SGLang is copied into this repository: ``make test`` downloads the wheels
(``pip download --no-deps``) into ``SGLANG_WHEELS`` (default ``~/.cache/areal-mcore/sglang``).
"""

from __future__ import annotations

import ast
import contextlib
import glob
import importlib.abc
import importlib.util
import os
import sys
import types
import zipfile

import pytest

WHEELS = os.environ.get("SGLANG_WHEELS", os.path.expanduser("~/.cache/areal-mcore/sglang"))
VERSIONS = ("0.5.23", "0.5.20")


def wheel(version: str) -> str:
    found = sorted(glob.glob(os.path.join(WHEELS, f"sglang-{version}-*.whl")))
    if not found:
        message = (f"sglang {version} wheel not in {WHEELS}: run `make sglang-wheels` "
                   f"(pip download --no-deps sglang=={version})")
        if os.environ.get("AREAL_REQUIRE_SYSDEPS"):
            pytest.fail(message)
        pytest.skip(message)
    return found[0]


def source(version: str, relpath: str) -> str:
    """The text of ``sglang/<relpath>`` in the wheel."""
    with zipfile.ZipFile(wheel(version)) as z:
        return z.read(f"sglang/{relpath}").decode()


class _WheelFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, path: str):
        self.zip = zipfile.ZipFile(path)
        self.names = set(self.zip.namelist())

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "sglang" and not fullname.startswith("sglang."):
            return None
        rel = fullname.replace(".", "/")
        if f"{rel}.py" in self.names:
            return importlib.util.spec_from_loader(fullname, self, origin=f"{rel}.py")
        if any(n.startswith(rel + "/") for n in self.names):  # a package: never its __init__
            spec = importlib.util.spec_from_loader(fullname, self, is_package=True)
            spec.submodule_search_locations = []
            return spec
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if module.__spec__.origin and module.__spec__.origin.endswith(".py"):
            code = self.zip.read(module.__spec__.origin).decode()
            exec(compile(code, f"{self.zip.filename}/{module.__spec__.origin}", "exec"),
                 module.__dict__)


@contextlib.contextmanager
def wheel_modules(version: str):
    """``importlib.import_module("sglang.…")`` inside serves that version's files.

    Modules already imported from another version are set aside first, and the ones
    imported here are dropped on exit (the objects taken out stay usable).
    """
    finder = _WheelFinder(wheel(version))

    def clear():
        for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
            del sys.modules[name]

    clear()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        clear()
        finder.zip.close()


def definitions(version: str, relpath: str, names: list[str], namespace: dict,
                module_name: str) -> types.ModuleType:
    """Top-level ``names`` (functions/classes, in file order) of ``sglang/<relpath>``,
    executed in a fresh module ``module_name`` whose globals start as ``namespace``."""
    text = source(version, relpath)
    tree = ast.parse(text)
    wanted = [n for n in tree.body if getattr(n, "name", None) in names]
    missing = set(names) - {n.name for n in wanted}
    assert not missing, f"{relpath} of sglang {version} has no {sorted(missing)}"
    module = types.ModuleType(module_name)
    module.__dict__.update(namespace)
    sys.modules[module_name] = module  # msgspec/pydantic resolve annotations through it
    body = "from __future__ import annotations\n" + "\n\n".join(
        ast.get_source_segment(text, n) if not n.decorator_list else
        "\n".join(text.splitlines()[n.decorator_list[0].lineno - 1:n.end_lineno])
        for n in wanted)
    exec(compile(body, f"sglang-{version}/{relpath}", "exec"), module.__dict__)
    return module


def init_custom_process_group(version: str):
    """SGLang's server side of the weight-update group (``srt/utils/common.py``)."""
    import torch

    release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    mod = definitions(version, "srt/utils/common.py", ["init_custom_process_group"],
                      {"torch_release": release}, f"_sglang_common_{version.replace('.', '_')}")
    return mod.init_custom_process_group
