"""The drafter interface every diffusion-drafter format implements.

A drafter turns contexts into logits for `gamma` masked positions after one bidirectional denoising
step; the core then samples K drafts from those marginals. Everything that is the same for all
formats lives here: input checks, the context window, the optional multi-step unmasking loop, and
the mapping from the drafter's own output vocabulary onto the verifier's (extra tokens such as the
mask are never proposed; a reduced head is scattered back through its draft->verifier table).
"""

from __future__ import annotations

import torch
from torch import nn


class Drafter(nn.Module):
    """Base class: subclasses implement `_block_logits` and `window_logits`.

    Attributes (set by subclasses):
      vocab_size: size of the verifier vocabulary that `draft_logits` covers.
      mask_token_id: input id of the mask token.
      shifted: True when the hidden state at i-1 predicts token i (Dream, DiffuCoder, block-causal).
      max_positions: largest sequence length (context + gamma) the position encoding supports.
      context_window: trailing context tokens the drafter sees (None: all).
      draft_to_verifier: LongTensor[V_draft] buffer for a reduced LM head, or None.
    """

    vocab_size: int
    mask_token_id: int
    shifted: bool
    max_positions: int
    context_window: int | None = None
    draft_to_verifier: torch.Tensor | None
    quantization: str = "none"  # set by drafter/quantize.py
    feature_taps: tuple[int, ...] = ()  # verifier layers whose outputs it reads (none: ids only)

    # ---- to implement -------------------------------------------------------------------------
    def _block_logits(self, contexts: list[torch.Tensor], block: torch.Tensor) -> torch.Tensor:
        """Logits [B,G,V_draft] at the G block positions following each context.

        `block[B,G]` holds the block's input ids (the mask id where still masked).
        """
        raise NotImplementedError

    def window_logits(self, input_ids: torch.Tensor, starts: torch.Tensor,
                      gamma: int) -> torch.Tensor:
        """Differentiable logits [B,M,G,V_draft]; window m of row b uses context input_ids[b,:s]."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, starts: torch.Tensor,
                gamma: int) -> torch.Tensor:
        """Alias of `window_logits`, so a peft-wrapped drafter can be called directly."""
        return self.window_logits(input_ids, starts, gamma)

    def input_lookahead(self, gamma: int) -> int:
        """Tokens past the last window start that `window_logits` reads (a batch must hold
        them): none, the context only, unless a drafter reads its targets' prefixes."""
        return 0

    # ---- cache (only the block-causal drafter keeps one) ----------------------------------------
    def clear_cache(self) -> None:
        """Drop every cached context encoding and zero the cache counters."""

    def cache_stats(self) -> dict[str, int]:
        """Counters of the context cache (empty for drafters that re-encode each step)."""
        return {}

    # ---- shared logic ---------------------------------------------------------------------------
    @property
    def draft_vocab_size(self) -> int:
        """Width of the drafter's own LM head output."""
        raise NotImplementedError

    def _device(self) -> torch.device:
        return next(self.parameters()).device

    def draft_room(self, context_length: int) -> int:
        """Longest draft the position encoding allows after a context of this many tokens
        (after the context window cuts it), so callers can shorten a draft instead of failing."""
        seen = context_length if self.context_window is None \
            else min(context_length, self.context_window)
        return self.max_positions - seen

    def prepare_contexts(self, contexts: list[torch.Tensor], gamma: int) -> list[torch.Tensor]:
        """Validate, move to CPU int64, and cut each context to the trailing `context_window`."""
        if not isinstance(gamma, int) or gamma < 1:
            raise ValueError(f"gamma must be a positive int, got {gamma!r}")
        if len(contexts) == 0:
            raise ValueError("contexts must hold at least one sequence")
        out = []
        for i, ctx in enumerate(contexts):
            ctx = torch.as_tensor(ctx).reshape(-1).to("cpu", torch.long)
            if ctx.numel() == 0:
                raise ValueError(f"context {i} is empty; the drafter needs at least one token")
            rows = self.model.embed_tokens.num_embeddings
            if int(ctx.min()) < 0 or int(ctx.max()) >= rows:
                raise ValueError(f"context {i} holds token ids outside the drafter's embedding "
                                 f"[0, {rows}): a tokenizer mismatch?")
            if self.context_window is not None and ctx.numel() > self.context_window:
                ctx = ctx[-self.context_window:]
            room = self.draft_room(ctx.numel())
            if gamma > room:
                raise ValueError(
                    f"context {i} has {ctx.numel()} tokens; with gamma={gamma} that needs "
                    f"{ctx.numel() + gamma} positions but the drafter supports max_positions="
                    f"{self.max_positions}: ask for at most {max(room, 0)} draft tokens "
                    "(`draft_room`) or set context_window")
            out.append(ctx)
        return out

    def to_verifier_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Map drafter-head logits [..., V_draft] onto float32 verifier logits [..., vocab_size].

        Ids the drafter must never propose (the mask, appended extras, ids a reduced head does not
        cover) get -inf.
        """
        logits = logits.float()
        d2t = self.draft_to_verifier
        if d2t is not None:
            out = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
            index = d2t.to(logits.device).expand(*logits.shape[:-1], d2t.numel())
            out.scatter_(-1, index, logits)
        else:
            out = logits[..., : self.vocab_size].clone()
        if 0 <= self.mask_token_id < self.vocab_size:
            out[..., self.mask_token_id] = float("-inf")
        return out

    @torch.no_grad()  # not inference_mode: callers may modify the returned tensor in place
    def draft_logits(self, contexts: list[torch.Tensor], gamma: int,
                     steps: int = 1) -> torch.Tensor:
        """Float32 logits [B, gamma, vocab_size] over the verifier vocabulary.

        steps == 1 is the paper's single denoising step. steps > 1 unmasks the most confident
        positions (argmax) a fraction at a time and re-runs; each position returns the logits of the
        step in which it was unmasked, so later positions are conditioned on the earlier choices.
        """
        contexts = self.prepare_contexts(contexts, gamma)
        if not isinstance(steps, int) or not 1 <= steps <= gamma:
            raise ValueError(f"steps must be an int in [1, gamma={gamma}], got {steps!r}")
        if not self.training:  # the serving case: toggling walks every module (~1 ms a call)
            return self._denoise(contexts, gamma, steps)
        self.eval()  # gradient checkpointing (training mode) would drop the KV cache
        try:
            return self._denoise(contexts, gamma, steps)
        finally:
            self.train()

    def _denoise(self, contexts: list[torch.Tensor], gamma: int, steps: int) -> torch.Tensor:
        """The unmasking loop of `draft_logits` (see there)."""
        batch = len(contexts)
        device = self._device()
        block = torch.full((batch, gamma), self.mask_token_id, dtype=torch.long, device=device)
        result = None
        decided = torch.zeros(batch, gamma, dtype=torch.bool, device=device)
        for step in range(steps):
            logits = self.to_verifier_vocab(self._block_logits(contexts, block))
            if result is None:
                result = logits
            else:
                result = torch.where(decided.unsqueeze(-1), result, logits)
            if step == steps - 1:
                break
            count = gamma * (step + 1) // steps - gamma * step // steps
            confidence = logits.softmax(-1).amax(-1).masked_fill(decided, -1.0)
            order = confidence.sort(dim=-1, descending=True, stable=True).indices[:, :count]
            tokens = logits.argmax(-1)
            block.scatter_(1, order, tokens.gather(1, order))
            decided.scatter_(1, order, True)
        return result
