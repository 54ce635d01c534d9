"""The proposer's side of adaptive drafting: it feeds the controller (`vllm_specdiff.adaptive`)
what each step measured and turns the controller's plan into each row's draft length.

A mixin of `SpecDiffProposer`: it reads the proposer's `gamma`, `config`, `adaptive` (None when
adaptive drafting is off), `tp_size`, `clock`, `stats` and `_last_end`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_specdiff.adaptive import Plan, TailCredit
from vllm_specdiff.plugin.proposer_rows import Row


class AdaptiveLengths:
    """Draft lengths from the adaptive controller, and the controller's observations."""

    gamma: int
    config: Any
    adaptive: Any
    tp_size: int
    stats: Any
    shape_choice: Any
    _shape_step: tuple[str, float] | None
    _last_end: float | None

    def _draft_lengths(self, decoded: list[Row], start: float, verified: int | None,
                       found: dict[int, np.ndarray]) -> list[int]:
        """Each decoded row's draft length this step: its room (fixed gamma), or the adaptive
        controller's plan, fed first with the verifier step that just ran (decode-only steps):
        rows with a lookup continuation (`found`) get the plan's lookup length, the others its
        drafter length, and probes go to drafter rows."""
        rooms = [row.room for row in decoded]
        if self.adaptive is None or not decoded:
            return rooms
        if verified is not None and self._last_end is not None:
            self.adaptive.observe_verifier(len(decoded), verified, start - self._last_end)
        credit = TailCredit.of([int(row.context.shape[0]) - row.start for row in decoded],
                               [row.index in found for row in decoded], slack=self.gamma)
        # the drafter rows' context not yet encoded; a probe takes the rows it saw last
        drafter_rows = [j for j, row in enumerate(decoded) if row.index not in found]
        encoded = {j: self._encoded(decoded[j]) for j in drafter_rows}
        order = sorted(drafter_rows, key=lambda j: (rooms[j] == 0, encoded[j], j))
        catch_up = sum(encoded.values()) / len(encoded) if encoded else None
        plan = self._rank0_plan(len(decoded), len(found), credit, catch_up,
                                encoded[order[0]] if order else None)
        lookup_gamma = plan.gamma if plan.lookup_gamma is None else plan.lookup_gamma
        lengths = [min(room, lookup_gamma if row.index in found else plan.gamma)
                   for row, room in zip(decoded, rooms, strict=True)]
        for j in order[: plan.probe_rows]:
            lengths[j] = min(rooms[j], plan.probe_gamma)
        return lengths

    def _rank0_plan(self, rows: int, lookup_rows: int, credit: TailCredit,
                    catch_up: float | None, probe_catch_up: int | None) -> Plan:
        """The controller's plan; with tensor parallelism, rank 0's (the rank whose drafts vLLM
        keeps) for every rank, so all ranks draft the same tokens from the same inputs (their
        timings differ) and tries (K > 1) stay the same on every rank."""
        assert self.adaptive is not None
        args = (rows, lookup_rows, credit, catch_up, probe_catch_up)
        if self.tp_size == 1:
            return self.adaptive.plan(*args)
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        plan = self.adaptive.plan(*args) if group.rank_in_group == 0 else None
        return group.broadcast_object(plan, src=0)

    def _encoded(self, row: Row) -> int:
        """Context tokens the drafter encodes for this row before drafting (its KV pool holds
        the context it last drafted from; a skipped step leaves one more token to catch up)."""
        fresh = int(row.context.shape[0]) - row.drafted_upto
        window = self.config.context_window
        return fresh if window is None else min(fresh, window)

    def _observe_full_tokens(self, drafts: list[list[int]], rows: list[tuple[Row, int]]
                             ) -> None:
        """Verifier tokens of a full-depth draft (a trie's nodes for K > 1), for the cost model."""
        full = [len(drafts[row.index]) for row, n in rows if n == self.gamma]
        if self.adaptive is not None and full:
            self.adaptive.observe_full_tokens(sum(full) / len(full))

    def _observe_call(self, encoded: int, elapsed: float) -> None:
        if self.adaptive is not None:
            if encoded:
                self.adaptive.observe_drafter(encoded, elapsed)
            else:
                self.adaptive.observe_overhead(elapsed)
        self._last_end = self.clock()

    def _shape_now(self) -> str:
        """This step's draft shape with best-first trees: the tree without adaptive drafting,
        else the measured choice; with tensor parallelism rank 0's for every rank, whose tries
        must be the same."""
        if self.shape_choice is None:
            return "tree"
        if self.tp_size == 1:
            return self.shape_choice.choose()
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        shape = self.shape_choice.choose() if group.rank_in_group == 0 else None
        return group.broadcast_object(shape, src=0)

    def _observe_shape(self, committed: int, start: float, verified: int | None) -> None:
        """With best-first trees under adaptive drafting: the last step's committed tokens and
        seconds (its verifier step and its drafting) for the shape it drafted. Steps that also
        prefilled, or drafted nothing with the drafter, tell nothing about a shape."""
        last, self._shape_step = self._shape_step, None
        if self.shape_choice is None or last is None or verified is None \
                or self._last_end is None:
            return
        shape, drafting = last
        self.shape_choice.observe(shape, committed, start - self._last_end + drafting)

    def _record_accepted(self, accepted: list[int], depths: list[int],
                         from_lookup: list[bool]) -> None:
        """Accepted draft tokens per row, recorded out of each row's own draft length (and, for
        the controller, by the draft's source)."""
        for depth in sorted(set(depths)):
            self.stats.record([a for a, d in zip(accepted, depths, strict=True) if d == depth],
                              depth)
        if self.adaptive is not None and accepted:
            self.adaptive.observe_accepted(accepted, depths, from_lookup)

