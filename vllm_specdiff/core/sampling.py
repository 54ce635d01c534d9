"""Turning logits into the distributions the method works with, and sampling K drafts.

The verifier's distribution `p` must be exactly what plain decoding would sample from (temperature,
then top-k, then top-p, as vLLM applies them), otherwise "lossless" would be lossless against the
wrong target. Temperature 0 means greedy: a one-hot distribution on the argmax.
"""

from __future__ import annotations

import torch

Scalar = float | int
PerRow = Scalar | torch.Tensor | None


def _per_row(value: Scalar | torch.Tensor, rows: int, dtype: torch.dtype, device: torch.device,
             name: str) -> torch.Tensor:
    """Broadcast a scalar or [rows] tensor setting to one value per row."""
    t = torch.as_tensor(value, dtype=dtype, device=device)
    if t.dim() == 0:
        return t.expand(rows)
    if t.shape != (rows,):
        raise ValueError(f"{name} must be a scalar or have shape [{rows}], got {tuple(t.shape)}")
    return t


def _apply_top_k(logits: torch.Tensor, top_k: Scalar | torch.Tensor) -> torch.Tensor:
    """Keep entries >= the k-th largest value (ties kept, as vLLM does); k <= 0 or k >= V: no-op."""
    rows, vocab = logits.shape
    k = _per_row(top_k, rows, torch.long, logits.device, "top_k")
    active = (k > 0) & (k < vocab)
    if not bool(active.any()):
        return logits
    kth_index = (k.clamp(1, vocab) - 1).unsqueeze(1)
    kth_value = logits.sort(dim=-1, descending=True).values.gather(1, kth_index)
    drop = (logits < kth_value) & active.unsqueeze(1)
    return logits.masked_fill(drop, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: Scalar | torch.Tensor) -> torch.Tensor:
    """Keep the smallest top set whose mass reaches p (always at least the argmax)."""
    rows, _ = logits.shape
    p = _per_row(top_p, rows, torch.float32, logits.device, "top_p")
    if bool(((p <= 0) | (p > 1)).any()):
        raise ValueError("top_p must be in (0, 1]")
    active = p < 1
    if not bool(active.any()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = (mass_before >= p.unsqueeze(1)) & active.unsqueeze(1)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def filter_logits(logits: torch.Tensor, temperature: Scalar | torch.Tensor,
                  top_k: PerRow = None, top_p: PerRow = None) -> torch.Tensor:
    """Return float32 `logits / temperature` with top-k/top-p-filtered entries set to -inf.

    Rows with temperature 0 are greedy: they are left unscaled (callers take their argmax).
    Settings are scalars or one value per row.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    logits = logits.float()
    rows = logits.shape[0]
    temp = _per_row(temperature, rows, torch.float32, logits.device, "temperature")
    if bool((temp < 0).any()) or not bool(torch.isfinite(temp).all()):
        raise ValueError("temperature must be finite and >= 0")
    scale = torch.where(temp == 0, torch.ones_like(temp), temp)
    out = logits / scale.unsqueeze(1)
    if top_k is not None:
        out = _apply_top_k(out, top_k)
    if top_p is not None:
        out = _apply_top_p(out, top_p)
    return out


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    index = logits.argmax(dim=-1, keepdim=True)
    return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, index, 1.0)


def target_probs(logits: torch.Tensor, temperature: Scalar | torch.Tensor,
                 top_k: PerRow = None, top_p: PerRow = None) -> torch.Tensor:
    """The verifier's sampling distribution per row; temperature-0 rows are one-hot argmax."""
    filtered = filter_logits(logits, temperature, top_k, top_p)
    temp = _per_row(temperature, logits.shape[0], torch.float32, logits.device, "temperature")
    probs = filtered.softmax(dim=-1)
    greedy = temp == 0
    if bool(greedy.any()):
        probs = torch.where(greedy.unsqueeze(1), _one_hot_argmax(logits.float()), probs)
    return probs


def draft_marginals(logits: torch.Tensor, temperature: float, top_k: int | None = None
                    ) -> torch.Tensor:
    """Per-position drafter marginals `q_j = softmax(logits_j / T_d)` over [B, G, V].

    T_d is the drafter's own temperature (independent of the request's); T_d == 0 gives one-hot
    argmax marginals, i.e. deterministic drafts.
    """
    if logits.dim() != 3:
        raise ValueError(f"drafter logits must be [B, G, V], got shape {tuple(logits.shape)}")
    if temperature < 0:
        raise ValueError(f"drafter temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"drafter top_k must be >= 0, got {top_k}")
    b, g, v = logits.shape
    flat = logits.reshape(b * g, v)
    return target_probs(flat, temperature, top_k).reshape(b, g, v)


def sample_drafts(marginals: torch.Tensor, num_drafts: int,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample K drafts independently per position: K * G categorical draws, no forward pass.

    Returns LongTensor [B, K, G]. Deterministic for a seeded generator on the same device.
    """
    if num_drafts < 1:
        raise ValueError(f"num_drafts must be >= 1, got {num_drafts}")
    b, g, v = marginals.shape
    draws = torch.multinomial(marginals.reshape(b * g, v), num_drafts, replacement=True,
                              generator=generator)
    return draws.reshape(b, g, num_drafts).permute(0, 2, 1).contiguous()
