"""A fix for vLLM 0.32's CPU fallback of the rejection sampler's `expand_kernel`.

Without Triton-CPU, vLLM replaces its Triton kernels with C++ versions
(`vllm/utils/cpu_triton_utils.py`). The `expand_kernel` wrapper converts its *output* tensor to
int64 before the C++ call and never copies the result back, so for a float output (the
per-token temperatures of `apply_sampling_constraints`) the tensor stays uninitialised memory.
Speculative decoding at temperature > 0 then divides the verifier's logits by garbage: target
probabilities become NaN/0/1, acceptance is wrong (not lossless) and seeded runs are not
reproducible. This affects every proposer on the CPU build (ngram too); greedy decoding does
not use the kernel. We register a dtype-generic torch implementation in its place.
"""

from __future__ import annotations

import torch

KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_any_dtype(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                     replace_from: float, replace_to: float,
                     MAX_NUM_TOKENS: int | None = None) -> None:  # noqa: N803 - kernel's name
    """output[cu[i-1]:cu[i]] = input[i] (replace_from -> replace_to), any dtype, in place."""
    cu = cu_num_tokens.to(torch.long)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from,
                         torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()].copy_(expanded)


def fix_cpu_expand_kernel() -> bool:
    """Install the fix when vLLM runs its C++ CPU fallback kernels; True if installed now.

    Each new vLLM worker re-registers the platform's kernels from `cpu_triton_utils`, so the
    fixed function also replaces the module attribute there: an engine started later in the same
    process (even a plain one) registers the fixed kernel instead of bringing the bug back.
    """
    try:
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON, dispatcher
    except ImportError:
        return False
    if HAS_TRITON or not current_platform.is_cpu():
        return False
    from vllm.utils import cpu_triton_utils

    cpu_triton_utils._expand_kernel_impl = expand_any_dtype
    registered = getattr(dispatcher, "_registry", {}).get(KERNEL)
    if registered is not None and registered[1] is expand_any_dtype:
        return False
    dispatcher.register_kernels({KERNEL: expand_any_dtype})
    return True
