"""Launch-size helpers shared by the Triton wrappers."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); 1 elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 1
    return _cuda_sm_count(device.index if device.index is not None else
                          torch.cuda.current_device())
