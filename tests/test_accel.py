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
    assert found == accel.Accelerators(cuda=False, transformer_engine=False, apex=False, wgrad_fusion=False)
    assert "fallback" in found.describe()


def test_with_cuda_uses_what_imports_and_falls_back_on_import_errors(monkeypatch):
    def fake_import(name):
        if name.startswith("apex"):
            raise OSError("libcudart.so: cannot open shared object file")
        return object()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib, "import_module", fake_import)
    assert accel.detect() == accel.Accelerators(cuda=True, transformer_engine=True, apex=False, wgrad_fusion=True)


def test_megatrons_fallback_warnings_are_filtered_and_said_in_one_line():
    import subprocess
    import sys

    code = ("import sys, warnings\n"
            "from areal_mcore import accel\n"
            "if sys.argv[1] == 'quiet': accel.quiet_known_warnings()\n"
            "import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs\n")
    runs = {mode: subprocess.run([sys.executable, "-W", "default", "-c", code, mode], capture_output=True,
                                 text=True, timeout=120) for mode in ("loud", "quiet")}
    assert runs["loud"].stderr.count("Falling back") >= 3  # what the filter is for
    assert "Falling back" not in runs["quiet"].stderr, runs["quiet"].stderr
    line = accel.fallbacks(accel.Accelerators(cuda=False, transformer_engine=False, apex=False))
    assert line.startswith("accelerators: no CUDA, so not using TransformerEngine") and "apex" in line
    assert accel.fallbacks(accel.Accelerators(cuda=True, transformer_engine=True, apex=True)) is None


def test_gradient_accumulation_fusion_needs_apexs_extension_not_just_te():
    """megatron's ColumnParallelLinear (the output layer, also under TE's spec) raises
    without apex's fused_weight_gradient_mlp_cuda: TE importing is not enough."""
    te_only = accel.Accelerators(cuda=True, transformer_engine=True, apex=True, wgrad_fusion=False)
    assert accel.wgrad_fusion("auto", te_only) is False
    with pytest.raises(ValueError, match="actor.gradient_accumulation_fusion=true needs apex's "
                                         "fused_weight_gradient_mlp_cuda"):
        accel.wgrad_fusion("true", te_only)
    full = accel.Accelerators(cuda=True, transformer_engine=True, apex=True, wgrad_fusion=True)
    assert accel.wgrad_fusion("auto", full) is True and accel.wgrad_fusion("false", full) is False


def test_wgrad_fusion_is_detected_by_importing_apexs_extension(monkeypatch):
    imported = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib, "import_module", lambda name: imported.append(name) or object())
    assert accel.detect().wgrad_fusion is True and "fused_weight_gradient_mlp_cuda" in imported
