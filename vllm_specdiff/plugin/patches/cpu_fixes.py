"""A guarded fix for vLLM 0.32's CPU fallback of the rejection sampler's `expand_kernel`.

Without Triton-CPU, vLLM replaces its Triton kernels with C++ versions
(`vllm/utils/cpu_triton_utils.py`). The `expand_kernel` wrapper converts its *output* tensor to
int64 before the C++ call and never copies the result back, so for a float output (the
per-token temperatures of `apply_sampling_constraints`) the tensor stays uninitialised memory.
Speculative decoding at temperature > 0 then divides the verifier's logits by garbage: target
probabilities become NaN/0/1, acceptance is wrong (not lossless) and seeded runs are not
reproducible. This affects every proposer on the CPU build (ngram too); greedy decoding does
not use the kernel.

The fix touches private vLLM internals, so it is guarded: the fallback is first run on a float
probe and replaced only if it really leaves the output wrong (a fixed vLLM keeps its own); the
replacement takes the kernel's own parameter names (vLLM's dispatcher then binds launch
arguments by name); and if the kernel's parameters or the modules holding it have changed, the
fix logs a warning and leaves vLLM as it is instead of failing the engine start.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
# vLLM 0.32's parameters of `expand_kernel`, in order; the replacement has exactly these names.
KERNEL_PARAMS = ("output_ptr", "input_ptr", "cu_num_tokens_ptr", "replace_from", "replace_to",
                 "MAX_NUM_TOKENS")
# What a changed vLLM layout raises while the fix looks up and probes its internals.
_LAYOUT_ERRORS = (ImportError, AttributeError, KeyError, TypeError, ValueError, RuntimeError)

_log = logging.getLogger("vllm.specdiff")  # under "vllm", so vLLM's log handlers print it
# vLLM's own fallback, kept when the fix replaces it (tests/plugin/patches/test_cpu_fixes.py
# probes it).
_replaced: dict[str, Callable[..., Any]] = {}


def expand_any_dtype(output_ptr: torch.Tensor, input_ptr: torch.Tensor,
                     cu_num_tokens_ptr: torch.Tensor, replace_from: float, replace_to: float,
                     MAX_NUM_TOKENS: int | None = None) -> None:  # noqa: N803 - kernel's name
    """output[cu[i-1]:cu[i]] = input[i] (replace_from -> replace_to), any dtype, in place."""
    cu = cu_num_tokens_ptr.to(torch.long)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_ptr == replace_from,
                         torch.as_tensor(replace_to, dtype=input_ptr.dtype), input_ptr)
    expanded = torch.repeat_interleave(values, counts)
    output_ptr[: expanded.numel()].copy_(expanded)


def kernel_params(kernel: Any) -> tuple[str, ...]:  # a Triton kernel or function
    """Parameter names of a Triton kernel, of vLLM's override wrapper, or of a plain function."""
    names = getattr(kernel, "arg_names", None)
    if names is None:
        names = inspect.signature(getattr(kernel, "func", kernel)).parameters
    return tuple(names)


def expand_is_broken(impl: Callable[..., Any]) -> bool:
    """Launch `impl` as vLLM's dispatcher does (arguments in the kernel's parameter order) on a
    float output pre-filled with NaN; broken if the output is not the expanded input."""
    output = torch.full((4,), float("nan"))
    launch = {"output_ptr": output, "input_ptr": torch.tensor([0.5, 0.0, 2.0]),
              "cu_num_tokens_ptr": torch.tensor([1, 3, 4], dtype=torch.int32),
              "replace_from": 0, "replace_to": 1, "MAX_NUM_TOKENS": 8}
    try:
        impl(*(launch[name] for name in KERNEL_PARAMS))
    except _LAYOUT_ERRORS:
        return True
    return not torch.equal(output, torch.tensor([0.5, 1.0, 1.0, 2.0]))


def fix_cpu_expand_kernel() -> bool:
    """Install the fix where vLLM runs its C++ fallback and that fallback is broken; True if
    installed now. Never raises: a changed vLLM layout only logs a warning.

    Each new vLLM worker re-registers the platform's kernels from `cpu_triton_utils`, so the
    fixed function also replaces the module attribute there: an engine started later in the same
    process (even a plain one) registers the fixed kernel instead of bringing the bug back.
    """
    try:
        return _install_if_broken()
    except _LAYOUT_ERRORS as e:
        _log.warning("SpecDiff: vLLM's CPU expand_kernel could not be checked (%s: %s); its fix "
                     "is not installed, so sampling at temperature > 0 with speculative decoding "
                     "may be wrong on this vLLM build", type(e).__name__, e)
        return False


def _install_if_broken() -> bool:
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON, dispatcher

    if HAS_TRITON or not current_platform.is_cpu():
        return False
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample import rejection_sampler

    current_platform.import_kernels()  # the C++ ops the fallback calls (a worker loads them too)
    params = kernel_params(rejection_sampler.expand_kernel)
    if params != KERNEL_PARAMS:
        _log.warning("SpecDiff: vLLM's expand_kernel takes %s, not %s as in vLLM 0.32; the CPU "
                     "fix is not installed, so sampling at temperature > 0 with speculative "
                     "decoding may be wrong on this vLLM build", params, KERNEL_PARAMS)
        return False
    fallback = cpu_triton_utils._expand_kernel_impl
    if fallback is not expand_any_dtype and expand_is_broken(fallback):
        _replaced.setdefault(KERNEL, fallback)
        cpu_triton_utils._expand_kernel_impl = expand_any_dtype
    registered = dispatcher._registry.get(KERNEL)
    if registered is None:  # no worker yet: register what the next one would
        needed = cpu_triton_utils._expand_kernel_impl is expand_any_dtype
    else:
        needed = registered[1] is not expand_any_dtype and expand_is_broken(registered[1])
    if needed:
        dispatcher.register_kernels({KERNEL: expand_any_dtype})
    return needed

