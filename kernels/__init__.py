"""Triton kernels, installed as ``areal_mcore.kernels``: fused vocab-parallel logprob +
entropy (``logprob``) and packed GAE (``gae``).

Each kernel has a pure-torch path with the same numbers; a config key chooses between
them (``KERNEL_CHOICES``). Triton is imported only when a Triton path is chosen, so the
package works without it. On CPU tensors the Triton kernels run only under Triton's
interpreter (``TRITON_INTERPRET=1``, read when the kernels are defined), which the tests
use.
"""

if __name__ == "kernels":
    # This folder is the package ``areal_mcore.kernels`` (setup.py's package_dir), never the
    # top-level ``kernels``. Where the repository root is on sys.path (``python -m``/``-c`` or
    # pytest run from it) it would shadow the environment's ``kernels`` package (the HF kernel
    # hub), which transformers >= 5.25 imports on every model import
    # (transformers/integrations/hub_kernels.py). So the name goes to the environment's
    # package where it has one.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        __name__, [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is None:
        # Where it has none, what Python itself gives for a folder on sys.path that is not a
        # package (PEP 420): an empty namespace package, no __file__ (module_from_spec gives it
        # a NamespaceLoader), so `from kernels import x` raises ImportError. transformers < 5.25
        # finds the folder, imports it, and counts exactly this as "not installed"
        # (utils/import_utils.py::_is_package_available); raising here would break its import.
        _spec = importlib.machinery.ModuleSpec(__name__, None, is_package=True)
    # Once this file has run, the import system returns what sys.modules holds under the name
    # (importlib._bootstrap._load_unlocked), so the real package takes this one's place.
    sys.modules[__name__] = _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
else:
    from areal_mcore.kernels.choice import (  # noqa: F401 (the package's API)
        KERNEL_CHOICES,
        check_runnable,
        triton_available,
        use_triton,
    )
