"""Backend choice: the env override, and a package that works where Triton is absent."""

import subprocess
import sys

import pytest
import torch

from triton_kernels import dispatch


def test_auto_uses_triton_only_on_cuda(monkeypatch):
    assert dispatch.select_backend(torch.device("cpu")) == "torch"
    assert dispatch.select_backend(torch.device("cuda")) == "triton"  # Triton is installed here
    monkeypatch.setenv("SPECDIFF_KERNELS", "torch")
    assert dispatch.select_backend(torch.device("cuda")) == "torch"
    monkeypatch.setenv("SPECDIFF_KERNELS", " Triton ")
    assert dispatch.select_backend(torch.device("cpu")) == "triton"  # interpreter is on


def test_bad_settings_are_rejected(monkeypatch):
    monkeypatch.setenv("SPECDIFF_KERNELS", "cuda")
    with pytest.raises(ValueError, match="SPECDIFF_KERNELS"):
        dispatch.select_backend(torch.device("cpu"))
    monkeypatch.setenv("SPECDIFF_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        dispatch.select_backend(torch.device("cpu"))


def test_without_triton_everything_falls_back_to_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.setattr(dispatch, "triton_available", dispatch.triton_available.__wrapped__)
    assert not dispatch.triton_available()
    assert dispatch.select_backend(torch.device("cuda")) == "torch"
    monkeypatch.setenv("SPECDIFF_KERNELS", "triton")
    with pytest.raises(ValueError, match="not installed"):
        dispatch.select_backend(torch.device("cuda"))


def test_package_import_does_not_import_triton():
    code = ("import sys, triton_kernels, triton_kernels.dispatch; "
            "assert 'triton' not in sys.modules, 'triton imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
