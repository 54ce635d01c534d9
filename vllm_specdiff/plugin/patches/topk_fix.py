"""A guarded fix for vLLM 0.32's CPU top-k path on a step with no draft tokens to verify.

On CPU, `apply_top_k_top_p_pytorch` sends top-k-only sampling (top_k set, top_p not) to
`apply_top_k_only`, which calls `k.max()`. The rejection sampler applies the sampling constraints
to the draft tokens' logits; when a step verifies none (every row's drafts were cut, e.g. all
requests of a batch one token from `max_tokens`), `k` is empty and `max()` raises, which kills
the engine. Measured on the tiny test models with every speculative method (SpecDiff with and
without prompt lookup) at temperature 1, top_k 3. An empty batch needs no mask, so the fixed
function returns the logits unchanged there and calls vLLM's own otherwise.

Guarded like `cpu_fixes`: installed only where vLLM's function really fails on an empty batch (a
fixed vLLM keeps its own), and a changed vLLM layout logs a warning instead of failing start-up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

_log = logging.getLogger("vllm.specdiff")
_LAYOUT_ERRORS = (ImportError, AttributeError, TypeError)


def empty_safe(top_k_only: Callable[..., Any]) -> Callable[..., Any]:
    """`top_k_only(logits, k)`, except that an empty batch comes back as it is."""

    def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        if k.numel() == 0:
            return logits
        return top_k_only(logits, k)

    apply_top_k_only.specdiff_wraps = top_k_only  # type: ignore[attr-defined]
    return apply_top_k_only


def fails_on_empty(top_k_only: Callable[..., Any]) -> bool:
    try:
        top_k_only(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    except RuntimeError:
        return True
    return False


def fix_cpu_top_k_only() -> bool:
    """Install the fix where vLLM's CPU top-k-only path fails on an empty batch; True if
    installed now. Never raises."""
    try:
        from vllm.v1.sample.ops import topk_topp_sampler

        current = topk_topp_sampler.apply_top_k_only
        if hasattr(current, "specdiff_wraps") or not fails_on_empty(current):
            return False
        topk_topp_sampler.apply_top_k_only = empty_safe(current)
        return True
    except _LAYOUT_ERRORS as e:
        _log.warning("SpecDiff: vLLM's CPU top-k sampler could not be checked (%s: %s); its fix "
                     "is not installed, so top-k-only sampling with speculative decoding may "
                     "fail on steps with no draft tokens", type(e).__name__, e)
        return False
