"""What a fresh install runs from the repository root: the top-level ``kernels/`` folder
(``areal_mcore.kernels``) never stands in for the environment's ``kernels`` package, which
transformers >= 5.25 imports on every model import; and the venv holds what the lock says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run_from_root(code: str) -> subprocess.CompletedProcess:
    # `python -c` from the root puts the root first on sys.path, as `python -m` and pytest do.
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_transformers_model_imports_from_the_repository_root_with_hf_kernels_installed():
    # On a tree whose kernels/ shadowed it, this raised "cannot import name 'CUDAProperties'
    # from 'kernels' (<repo>/kernels/__init__.py)".
    code = ("import importlib.metadata, kernels\n"
            "print(kernels.__file__, importlib.metadata.version('kernels'))\n"
            "from transformers import Qwen2ForCausalLM\n"
            "import areal_mcore.kernels as ours\n"
            "print(ours.__name__, ours.KERNEL_CHOICES)\n")
    out = _run_from_root(code)
    assert out.returncode == 0, out.stderr[-3000:]
    hf_file, ours = out.stdout.splitlines()
    assert "site-packages" in hf_file and not hf_file.startswith(str(ROOT / "kernels")), hf_file
    assert ours == "areal_mcore.kernels ('auto', 'triton', 'torch')"


def test_kernels_from_the_repository_root_without_hf_kernels_is_an_empty_namespace():
    # Without the environment's package, `import kernels` gives what Python gives for any folder
    # on sys.path (PEP 420): nothing to import from it, and no __file__, which transformers < 5.25
    # (the vLLM venv's 5.19) counts as "not installed". Our kernels stay out of reach.
    code = ("import sys\n"
            "sys.path = [p for p in sys.path if 'site-packages' not in p]\n"
            "import kernels\n"
            "assert getattr(kernels, '__file__', None) is None, kernels.__file__\n"
            "assert list(kernels.__path__) == [] and not hasattr(kernels, 'use_triton')\n"
            "try:\n"
            "    from kernels import logprob\n"
            "except ImportError:\n"
            "    print('ImportError')\n")
    out = _run_from_root(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ImportError"


def _locked(lock: Path) -> dict[str, str]:
    pins = re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)", lock.read_text(), flags=re.M)
    return {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in pins}


def test_main_venv_holds_exactly_the_locked_versions():
    import sysconfig
    from importlib import metadata

    locked = _locked(ROOT / "locks" / "main.txt")
    # The venv's own site-packages only: once imported, setuptools puts its vendored
    # packages (setuptools/_vendor, with their own metadata) on sys.path.
    site = [sysconfig.get_paths()["purelib"]]
    installed = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(): d.version
                 for d in metadata.distributions(path=site)}
    installed.pop("areal-mcore")
    # pip and setuptools come with `python -m venv`, outside any lock.
    for seed in ("pip", "setuptools"):
        if seed not in locked:
            installed.pop(seed, None)
    assert installed == locked


def test_no_script_folder_module_shadows_an_installed_package():
    # `python bench/x.py` puts bench/ first on sys.path: a bench/kernels.py there shadowed
    # HF's `kernels` package, and transformers >= 5.25 failed to import in every benchmark
    # run as a script. The same holds for tools/ and scripts/.
    import importlib.metadata

    installed = {name for dist in importlib.metadata.distributions()
                 for name in (dist.read_text("top_level.txt") or "").split()}
    installed |= {p.split("/")[0].removesuffix(".py") for dist in importlib.metadata.distributions()
                  for p in map(str, dist.files or ()) if p.count("/") <= 1 and not p.startswith(("..", "_"))}
    ours = {p.stem for folder in ("bench", "tools", "scripts") for p in (ROOT / folder).glob("*.py")}
    assert not ours & installed, f"rename these: they shadow installed packages: {sorted(ours & installed)}"
