"""Verifier features injected into the block-causal drafter's context stream.

The second way to condition a drafter on the verifier (the first is `conditioned.py`'s KV
injection): keep the trained standalone block-causal drafter and add, before each of its layers,
a projection of the verifier's fused tapped features to the hidden state of every context token.
The projections start at zero, so training starts exactly from the standalone drafter's acceptance
and can only climb from there.

Context token i receives the verifier's features of position i - 1 (what the verifier computed
when it predicted token i): at serving time the last committed token has no verifier state yet,
so no token ever sees features of its own position. The mask block gets none.
"""

from __future__ import annotations

import torch
from torch import nn


class FeatureInjection(nn.Module):
    """fc + hidden_norm (fused context, as DFlash), then one zero-initialised projection per
    drafter layer."""

    def __init__(self, target_layer_ids: tuple[int, ...], hidden_size: int, num_layers: int,
                 eps: float) -> None:
        super().__init__()
        self.target_layer_ids = tuple(target_layer_ids)
        self.fc = nn.Linear(hidden_size * len(self.target_layer_ids), hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(hidden_size, eps=eps)
        self.inject = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=False)
                                    for _ in range(num_layers))
        nn.init.normal_(self.fc.weight, std=0.02)
        for proj in self.inject:
            nn.init.zeros_(proj.weight)

    def layer_bias(self, features: torch.Tensor, total: int) -> list[torch.Tensor]:
        """Per layer, the additive term [B,total,H] for a sequence whose first L positions are
        the context with features[B,L,F] (the rest, mask blocks, get zero)."""
        b, length, _ = features.shape
        dtype = self.fc.weight.dtype
        shifted = torch.zeros(b, total, features.shape[-1], dtype=dtype, device=features.device)
        shifted[:, 1:length] = features[:, :length - 1].to(dtype)
        ctx = self.hidden_norm(self.fc(shifted))  # RMSNorm(0) = 0: no feature, no term
        ctx = ctx * (torch.arange(total, device=features.device) < length)[None, :, None]
        return [proj(ctx) for proj in self.inject]
