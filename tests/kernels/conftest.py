"""Run the Triton kernels on CPU through Triton's interpreter.

`@triton.jit` decides at decoration time whether a kernel is interpreted, so TRITON_INTERPRET
must be set before the kernel modules are imported (or they are reloaded). It is set only for
that import and, per test, by a fixture, so other test packages do not inherit it.
"""

import importlib
import os
import sys

import pytest

_KERNEL_MODULES = ("vllm_specdiff_kernels.tree_attention_triton",
                   "vllm_specdiff_kernels.draft_logprobs_triton")

_previous = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    for _name in _KERNEL_MODULES:
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])
        else:
            importlib.import_module(_name)
finally:
    if _previous is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _previous


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("SPECDIFF_KERNELS", raising=False)
