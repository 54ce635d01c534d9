"""A guarded speed fix: a speculative step without any draft token samples as a plain step.

vLLM 0.32's `GPUModelRunner._prepare_inputs` builds a `SpecDecodeMetadata` for every step of a
speculative engine, and `_sample` sends every step with one through the rejection sampler, even
when no request has a draft token. The adaptive controller drafts nothing on most steps at batch
16, and there the rejection sampler costs ~1.1 ms a step against the plain sampler's ~0.3 ms
(cProfile: benchmarks/step_overhead.py): it samples the bonus tokens with full-vocabulary
logprobs (`max_num_logprobs=-1`, needed or not) and runs the rejection path's logits
processors, constraints and kernels on empty draft tensors.

With no draft token the rejection sampler's output is its bonus sample, drawn by the same
`Sampler` with the same sampling metadata as `_sample(logits, None)` (the logits rows are the
same: one per request, its last token), so the wrapper calls `_sample(logits, None)` there:
- same RNG use: the bonus sample draws from the same generators; the rejection-only draws
  (`generate_uniform_probs`, `sample_recovered_tokens`) leave the generator of a row without
  drafts alone (vLLM's own `sample_recovered_tokens` still draws from torch's global stream,
  which no seeded request reads);
- same logits processors, penalties, allowed/bad words, min_tokens, logit bias: the bonus call
  applies them as a plain step does (`predict_bonus_token` only adds the row's draft tokens to
  the output tokens, none here);
- same output: `sampled_token_ids` [num_reqs, 1] int32, logprobs gathered from the same rows;
  after `_sample` nothing reads which sampler ran (bookkeeping takes the `max_gen_len == 1`
  branch in both cases; the drafter still gets the step's `spec_decode_metadata`).
Exception kept on the rejection sampler: a request tracked by the thinking-budget state holder.
Its forcing logic counts rows by draft length in spec mode unless `predict_bonus_token`, so a
plain call from a speculative engine would force the wrong rows.

Guarded like `topk_fix`: installed once (a marked wrapper is not wrapped again), only where
`_sample` and `SpecDecodeMetadata` have vLLM 0.32's layout; a changed layout logs a warning and
leaves vLLM as it is.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

_log = logging.getLogger("vllm.specdiff")
_LAYOUT_ERRORS = (ImportError, AttributeError, TypeError, ValueError)
SAMPLE_PARAMS = ("self", "logits", "spec_decode_metadata")


def has_no_draft(spec_decode_metadata: Any) -> bool:
    """True for a step's metadata in which no request has a draft token."""
    return spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0


def thinking_budget_active(runner: Any) -> bool:
    """True while the runner's thinking-budget holder tracks a request (module docstring)."""
    sampling_metadata = getattr(getattr(runner, "input_batch", None), "sampling_metadata", None)
    holder = getattr(sampling_metadata, "thinking_budget_state_holder", None)
    return holder is not None and bool(holder.has_tracked_requests())


def plain_when_draftless(sample: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's `_sample(self, logits, spec_decode_metadata)`, with `None` as the metadata of a
    step without draft tokens (the plain sampler's path)."""

    def _sample(self: Any, logits: torch.Tensor | None,
                spec_decode_metadata: Any) -> Any:
        if has_no_draft(spec_decode_metadata) and not thinking_budget_active(self):
            spec_decode_metadata = None
        return sample(self, logits, spec_decode_metadata)

    _sample.specdiff_wraps = sample  # type: ignore[attr-defined]
    return _sample


def _check_layout(sample: Callable[..., Any]) -> None:
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    found = tuple(inspect.signature(sample).parameters)
    if found != SAMPLE_PARAMS:
        raise ValueError(f"_sample takes {found}, not {SAMPLE_PARAMS} as in vLLM 0.32")
    if SpecDecodeMetadata.make_dummy([[]], torch.device("cpu")).max_spec_len != 0:
        raise ValueError("SpecDecodeMetadata.max_spec_len is not 0 without draft tokens")


def fix_draftless_steps() -> bool:
    """Install the wrapper on `GPUModelRunner._sample` (the CPU runner inherits it); True if
    installed now. Never raises."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        current = GPUModelRunner._sample
        if hasattr(current, "specdiff_wraps"):
            return False
        _check_layout(current)
        GPUModelRunner._sample = plain_when_draftless(current)  # type: ignore[method-assign]
        return True
    except _LAYOUT_ERRORS as e:
        _log.warning("SpecDiff: vLLM's GPUModelRunner._sample could not be checked (%s: %s); "
                     "steps without draft tokens keep going through the rejection sampler",
                     type(e).__name__, e)
        return False


def restore_vllm_sample() -> bool:
    """Put vLLM's own `_sample` back (the tests' negative control); True if it was wrapped."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = getattr(GPUModelRunner._sample, "specdiff_wraps", None)
    if original is None:
        return False
    GPUModelRunner._sample = original  # type: ignore[method-assign]
    return True
