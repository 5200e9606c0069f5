import importlib

import pytest
import torch

from areal_mcore import accel


@pytest.fixture(autouse=True)
def _fresh_detection():
    accel.detect.cache_clear()
    yield
    accel.detect.cache_clear()


def test_without_cuda_nothing_is_used_even_if_installed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(importlib, "import_module", lambda name: object())
    found = accel.detect()
    assert found == accel.Accelerators(cuda=False, transformer_engine=False, apex=False)
    assert "fallback" in found.describe()


def test_with_cuda_uses_what_imports_and_falls_back_on_import_errors(monkeypatch):
    def fake_import(name):
        if name.startswith("apex"):
            raise OSError("libcudart.so: cannot open shared object file")
        return object()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib, "import_module", fake_import)
    assert accel.detect() == accel.Accelerators(cuda=True, transformer_engine=True, apex=False)
