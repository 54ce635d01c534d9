"""The proposer's side of a drafter that reads the verifier (`specdiff_conditioned`): the
runner's tapped states go into the per-request context cache, and drafts come from it.

A mixin of `SpecDiffProposer`: it reads the proposer's `drafter`, `config`, `clock` and `_lock`.
Projecting a step's states is drafting work that only a draft needs, and the runner hands them
over before the adaptive controller has decided whether anything is drafted: `observe_features`
only files them (the cache defers their projection, `ConditionedContextCache`), and the requests
`propose` drafts catch up in one projection inside the drafter call. A step that drafts nothing
pays the filing alone.

The runner still captures every step's states: a skipped capture would be a hole in every later
draft's context (the states of a committed position are never computed again), and whether a
request drafts again is not known when its step runs (docs/adaptive.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from vllm_specdiff.drafter.conditioned_state import DEFAULT_CACHE_BYTES, ConditionedContextCache

WARM_UP_ID = "specdiff-warm-up"  # the start-up draft's request id in the context cache


class ConditionedContexts:
    """Per-request contexts of a drafter that reads the verifier, filed and drafted from."""

    drafter: Any
    config: Any
    clock: Callable[[], float]
    _lock: threading.Lock
    drafter_seconds: float
    contexts: ConditionedContextCache | None
    _row_requests: list[str]
    _filed_seconds: float

    def _load_contexts(self) -> None:
        """The context cache of the loaded drafter."""
        self.contexts = ConditionedContextCache(
            self.drafter, self.config.cache_bytes or DEFAULT_CACHE_BYTES)

    def verifier_taps(self) -> tuple[int, ...]:
        """After `load_model`, for the feature-capturing runner: the verifier layers whose
        outputs the drafter reads (DFlash's numbering: tap L is the output of layer L); () for a
        drafter that reads token ids only."""
        return tuple(self.drafter.feature_taps) if self.contexts is not None else ()

    def _warm_up_contexts(self, context: torch.Tensor) -> None:
        """One throwaway draft from a dummy context of zero features (projection included), left
        out of the cache's counts."""
        assert self.contexts is not None
        features = torch.zeros(context.shape[0], self.drafter.cfg.feature_size)
        self.contexts.extend(WARM_UP_ID, features, 0)
        self.contexts.block_logits([WARM_UP_ID], context[-1:], [context.shape[0]])
        self.contexts.drop(WARM_UP_ID)
        self.contexts.restarts = self.contexts.projections = self.contexts.projected_rows = 0

    def observe_features(self, updates: list[tuple[str, torch.Tensor, int]],
                         finished: Any = ()) -> None:
        """From the runner, after a verifier step: per batch row, its request's id and newly
        committed positions' tapped states (features, first position); and the requests that
        finished (their contexts are dropped). The states are filed, projected when drafted."""
        if self.contexts is None:
            return
        start = self.clock()
        for req_id in finished or ():
            self.contexts.drop(req_id)
        self.contexts.extend_many(updates)
        self._row_requests = [req_id for req_id, _, _ in updates]
        elapsed = self.clock() - start
        with self._lock:  # filing the context is drafting work: the step's drafter share
            self.drafter_seconds += elapsed
            self._filed_seconds += elapsed

    def _catch_up(self, indices: list[int]) -> None:
        """Before a step's drafts: the deferred positions of the batch rows drafted, projected
        in one call (draft lengths may split them over several drafter calls)."""
        if self.contexts is not None:
            self.contexts.catch_up([self._row_requests[i] for i in indices])

    def _conditioned_logits(self, contexts: list[torch.Tensor], indices: list[int],
                            length: int) -> torch.Tensor:
        """[B, length, V] over the verifier's vocabulary, one block per row, from each request's
        cached context (its deferred positions projected first); the anchor (the last committed
        token) sits right after it. The rows' token ids go along: the cache records them to
        reuse a prompt prefix vLLM's prefix cache skipped (ConditionedContextCache)."""
        assert self.contexts is not None
        anchors = torch.tensor([int(c[-1]) for c in contexts])
        logits = self.contexts.block_logits([self._row_requests[i] for i in indices], anchors,
                                            [c.shape[0] - 1 for c in contexts], contexts)
        return self.drafter.to_verifier_vocab(logits[:, :length])
