"""On CPU, megatron-core's fused element-wise functions run eagerly, and importing it
compiles nothing.

megatron decorates its fusions (bias-GeLU/SwiGLU/GeGLU, the MoE router's expert bias, the
attention output gate, ...) with ``jit_fuser``, which ``megatron/core/jit.py`` binds to
``torch.compile`` when it is first imported (``enable_jit_fuser``, torch >= 2.2; the same
file in 0.16.1 and 0.19.2). Each decoration builds a compile wrapper, which imports dynamo
and inductor: 4.7 s of the 11 s that ``import megatron.core`` took on a 2-core AVX2 machine,
paid again by every process that imports megatron (trainer ranks, converter ranks, the
test workers). Called on CPU, a compiled fusion would then build C++ kernels with inductor
at its first call.

``install()`` (run by ``areal_mcore/__init__.py``, so before any of our modules imports
megatron) registers an import hook for ``megatron.core.jit`` alone: when that module is
executed on a machine without CUDA, ``torch.compile`` is an identity decorator for the
duration, so ``jit_fuser`` binds to it and every fusion stays a plain function. On a GPU
machine the hook changes nothing, and nothing but that one module's import is touched.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_JIT = "megatron.core.jit"


def _eager(model=None, **_options):
    """``torch.compile``'s two call forms (``compile(fn)``, ``compile(**options)(fn)``), compiling nothing."""
    return model if model is not None else (lambda fn: fn)


class _EagerJitFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != _JIT:
            return None
        uninstall()  # once: megatron.core.jit is imported once per process
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        import torch

        if spec is None or spec.loader is None or torch.cuda.is_available():
            return spec
        execute = spec.loader.exec_module

        def exec_eagerly(module):
            compile_ = torch.compile
            torch.compile = _eager
            try:
                execute(module)
            finally:
                torch.compile = compile_

        spec.loader.exec_module = exec_eagerly
        return spec


_FINDER = _EagerJitFinder()


def install() -> None:
    """Registers the hook unless megatron's jit module is already imported (then too late)."""
    if _JIT not in sys.modules and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


def fusions_are_eager() -> bool:
    """Whether megatron's ``jit_fuser`` compiles nothing in this process."""
    jit = sys.modules.get(_JIT)
    return jit is not None and jit.jit_fuser is _eager
