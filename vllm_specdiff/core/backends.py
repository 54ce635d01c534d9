"""Which implementation of a kernel runs: the caller's torch reference or a registered Triton one.

The core owns the choice; it never imports a kernels package. A kernels package registers its
Triton implementations with `register_triton` (the project's own does so on import and through
the `vllm_specdiff.kernels` entry-point group, which is loaded the first time a Triton path could
be chosen). Nothing here imports Triton until that happens: vLLM's CPU build has none.

`SPECDIFF_KERNELS` overrides the choice (read at every call):
    auto   (default) Triton when the tensors are on CUDA, Triton imports and an implementation
           is registered; else the torch reference;
    torch  always the torch reference;
    triton always Triton; on CPU tensors this needs TRITON_INTERPRET=1 (the interpreter, which
           is how the tests check the kernels without a GPU).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

import torch

ENV_VAR = "SPECDIFF_KERNELS"
BACKENDS = ("auto", "torch", "triton")
ENTRY_POINT_GROUP = "vllm_specdiff.kernels"

Kernel = Callable[..., Any]
_triton_loaders: dict[str, Callable[[], Kernel]] = {}


def register_triton(kernel: str, loader: Callable[[], Kernel]) -> None:
    """Register the Triton implementation of `kernel`; `loader` imports it (and Triton) lazily."""
    _triton_loaders[kernel] = loader


@functools.cache
def load_registered_kernels() -> None:
    """Run every `vllm_specdiff.kernels` entry point once (each one calls `register_triton`)."""
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        entry.load()()


def triton_registered(kernel: str) -> bool:
    """True when some kernels package registered a Triton implementation of `kernel`."""
    if kernel not in _triton_loaders:
        load_registered_kernels()
    return kernel in _triton_loaders


@functools.cache
def triton_available() -> bool:
    """True when Triton imports (it is absent from vLLM's CPU build)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def requested_backend() -> str:
    """The validated value of SPECDIFF_KERNELS (default 'auto')."""
    choice = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={choice!r} is not one of {', '.join(BACKENDS)}")
    return choice


def select_backend(kernel: str, device: torch.device) -> str:
    """'triton' or 'torch' for `kernel` on tensors on `device`, honouring SPECDIFF_KERNELS."""
    choice = requested_backend()
    if choice == "torch":
        return "torch"
    if choice == "auto":
        usable = device.type == "cuda" and triton_available() and triton_registered(kernel)
        return "triton" if usable else "torch"
    if not triton_available():
        raise ValueError(f"{ENV_VAR}=triton but Triton is not installed")
    if not triton_registered(kernel):
        raise ValueError(f"{ENV_VAR}=triton but no Triton implementation of {kernel!r} is "
                         f"registered (entry-point group {ENTRY_POINT_GROUP!r}; is vllm-specdiff "
                         "installed?)")
    if device.type != "cuda" and not _interpreting():
        raise ValueError(f"{ENV_VAR}=triton with {device.type} tensors needs "
                         "TRITON_INTERPRET=1 (Triton compiles for GPUs only)")
    return "triton"


def implementation(kernel: str, device: torch.device, torch_impl: Kernel) -> Kernel:
    """The function to call for `kernel` on `device`: the registered Triton one or `torch_impl`."""
    if select_backend(kernel, device) == "triton":
        return _triton_loaders[kernel]()
    return torch_impl
