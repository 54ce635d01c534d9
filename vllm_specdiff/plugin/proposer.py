"""`SpecDiffProposer`: the diffusion drafter as a vLLM 0.32 custom proposer.

vLLM loads it when `speculative_config.model` is the dotted path
`vllm_specdiff.SpecDiffProposer` (method "custom_class"): the runner constructs it with the
`VllmConfig`, calls `load_model(target_model)` once, then after every engine step
`propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)`, one row per
batch slot, and verifies the returned drafts itself. It passes no draft probabilities, so vLLM's
rejection sampler treats each draft as a point mass: at temperature 0 it accepts while the draft
equals the argmax, at temperature > 0 it accepts x with probability p(x) and otherwise samples
from p with x removed, which is the paper's lossless rule (ALGORITHM.md section 3) for K = 1.

Rows carry no request ids and are reordered, preempted and finished between steps; the drafter's
KV pool therefore finds each row's cached context by longest common prefix, and is bounded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm_specdiff.adaptive import AdaptiveDrafting, Plan, TailCredit
from vllm_specdiff.core import SpecDecodeStats, draft_marginals, sample_drafts
from vllm_specdiff.core.datastore import Datastore
from vllm_specdiff.plugin.candidates import candidate_drafts, lookup_continuations, ngram_draft
from vllm_specdiff.plugin.config import (
    SpecDiffConfig,
    check_drafter_for,
    check_num_speculative_tokens,
    parse_specdiff_config,
    tree_worker,
)
from vllm_specdiff.plugin.trie import RequestTrie, build_request_trie
from vllm_specdiff.plugin.vllm_plugin import install_vllm_fixes

# Tokens of context that identify a row between two steps (with its length) when counting how
# many drafts were accepted; a collision of two different rows only swaps their entries.
_SIGNATURE_TOKENS = 8
WARM_UP_CONTEXT = 32  # tokens of the start-up draft's dummy context


@dataclass(frozen=True)
class _Row:
    """A row that just sampled tokens: batch index, committed context (a view of vLLM's token
    array, read only during the step), the most draft tokens that fit (position limits), the
    context length the drafter last encoded for it, and the context length when the request
    was first seen (its output tokens since: its progress)."""

    index: int
    context: np.ndarray
    room: int
    drafted_upto: int
    start: int


@dataclass(frozen=True)
class _Pending:
    """What one step left for the next: the row's draft length (accepted counts are out of
    it), the draft tokens the verifier got (a trie's nodes for K > 1), `drafted_upto` and
    `start`."""

    depth: int
    tokens: int
    drafted_upto: int
    start: int
    lookup: bool = False  # the draft was a prompt-lookup continuation


def _logger() -> Any:
    from vllm.logger import init_logger

    return init_logger("vllm.specdiff")  # under "vllm", so vLLM's log handlers print it


def verifier_tokenizer(model_config: Any) -> Any:
    """vLLM's own tokenizer of the served model, whatever names it (a hub id, a local
    directory, a ModelScope id); None when vLLM skips tokenizer init. `model_config.tokenizer`
    is only a name, not necessarily a directory to read a vocabulary from."""
    from vllm.tokenizers import cached_tokenizer_from_config

    return cached_tokenizer_from_config(model_config)


class SpecDiffProposer:
    """Drafts `num_speculative_tokens` tokens per request with a masked-diffusion drafter (K=1).

    The drafter attribute is `self.drafter`, never `self.model`: vLLM's runner inspects
    `drafter.model` to decide how to treat a proposer.
    """

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        self.gamma = check_num_speculative_tokens(
            None if spec is None else spec.num_speculative_tokens,
            "speculative_config.num_speculative_tokens")
        self.config: SpecDiffConfig = parse_specdiff_config(vllm_config.additional_config,
                                                            gamma=self.gamma)
        install_vllm_fixes()
        model_config = vllm_config.model_config
        check_drafter_for(str(model_config.model), self.config.drafter)
        self.max_model_len = int(model_config.max_model_len)
        self.verifier_vocab_size = int(model_config.get_vocab_size())
        self.model_config = model_config
        max_num_seqs = int(vllm_config.scheduler_config.max_num_seqs)
        # K = 1 with "ngram": rows whose context repeats draft the prompt-lookup continuation
        self.lookup_enabled = self.config.num_drafts == 1 and "ngram" in self.config.candidates
        self.datastore = None if self.config.datastore is None \
            else Datastore.load(Path(self.config.datastore))
        if self.datastore is not None and self.datastore.tokens.size \
                and int(self.datastore.tokens.max()) >= self.verifier_vocab_size:
            raise ValueError(f"additional_config['specdiff']['datastore']: "
                             f"{self.config.datastore} holds token ids up to "
                             f"{int(self.datastore.tokens.max())}, outside the verifier's "
                             f"vocabulary ({self.verifier_vocab_size}): it was built from "
                             "another model's data")
        parallel = getattr(vllm_config, "parallel_config", None)
        self.tp_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        self.cache_size = self.config.cache_size or max(16, 2 * max_num_seqs)
        self.drafter: Any = None
        self.drafter_path: str | None = None
        self.generator: torch.Generator | None = None
        self.stats = self._new_stats()
        self.propose_calls = 0
        self.drafted_rows = 0
        self.lookup_drafts = 0  # K = 1 with "ngram": rows drafted by prompt lookup
        self.datastore_drafts = 0  # of those, rows drafted from the datastore
        self.drafter_seconds = 0.0
        # per context signature, one entry per row (rows with identical contexts, e.g. greedy
        # n > 1, each keep theirs)
        self._pending: dict[tuple[int, bytes], list[_Pending]] = {}
        self._last_end: float | None = None  # end of the last propose call (verifier timing)
        # The clock the cost model reads (seconds). A bench that steps several engines in turn
        # gives each proposer one that stands still while the other engines step, so the
        # verifier time it infers between two calls is its own engine's.
        self.clock: Callable[[], float] = time.perf_counter
        self.adaptive = AdaptiveDrafting(
            self.gamma,
            full_tokens=self.gamma if self.config.num_drafts == 1
            else self.config.max_tree_tokens - 1,
            chain_choices=self.config.num_drafts == 1,
            lookup=self.lookup_enabled,
            margin=self.config.draft_margin,
            refill_ratio=self.config.refill_ratio) if self.config.adaptive else None
        self._lock = threading.Lock()
        self._last_log = time.monotonic()
        self._logged = (0, 0.0, 0)
        # Tree verification (K > 1): the runner that verifies tries turns it on, says which rows
        # may get one (others get the argmax draft) and reads back each row's trie.
        self.trees_enabled = False
        self.tree_rows: np.ndarray | None = None
        self.last_tries: list[RequestTrie | None] = []
        self.tree_stats = SpecDecodeStats()
        self.chosen_sources: dict[str, int] = {}
        self.tau_chosen = 0.0
        self.tau_all = 0.0
        self.tree_walks = self.tree_walks_several = 0  # selection "tree": walked steps

    # ---- vLLM interface -------------------------------------------------------------------------
    def load_model(self, target_model: Any = None, *args: Any, **kwargs: Any) -> None:
        """Load the drafter next to the verifier (vLLM calls this after loading the target)."""
        from vllm_specdiff.drafter import load_drafter

        if self.config.num_drafts > 1 and not self.trees_enabled:
            worker = tree_worker()
            raise ValueError(f"additional_config['specdiff']['num_drafts'] = "
                             f"{self.config.num_drafts} needs the "
                             f"tree-verifying worker: add worker_cls={worker!r} "
                             f"(--worker-cls {worker})")
        device = torch.device("cpu")
        if isinstance(target_model, torch.nn.Module):
            param = next(target_model.parameters(), None)
            if param is not None:
                device = param.device
        path = self.config.drafter
        if path is None:
            from vllm_specdiff.models import prepare_drafter

            path = str(prepare_drafter())
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        self.drafter = load_drafter(
            path, lora=self.config.lora, dtype=dtype, device=device,
            context_window=self.config.context_window,
            verifier_vocab_size=self.verifier_vocab_size, cache_size=self.cache_size,
            verifier_tokenizer=verifier_tokenizer(self.model_config),
            cache_bytes=self.config.cache_bytes, quantize=self.config.quantize)
        self._check_positions()
        self._warm_up()
        self.drafter_path = path
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(self.config.seed)
        _logger().info("SpecDiff drafter %s loaded (gamma=%d, T_d=%s, steps=%d, cache=%d)",
                       path, self.gamma, self.config.drafter_temperature, self.config.steps,
                       self.cache_size)

    def _warm_up(self) -> None:
        """One throwaway draft before serving. The drafter's first call pays one-time costs
        (kernel and allocator set-up: 0.5-11 s measured inside the engine, then a few ms per
        call) that would otherwise land in the first request's latency and, with adaptive
        drafting, in the drafter cost model, which then judges drafting too dear to try."""
        context = torch.zeros(min(WARM_UP_CONTEXT, self.drafter.max_positions - self.gamma),
                              dtype=torch.long)
        start = time.perf_counter()
        with torch.inference_mode():
            self.drafter.draft_logits([context], self.gamma,
                                      steps=min(self.config.steps, self.gamma))
        self.drafter.clear_cache()  # the dummy context must not sit in the KV pool
        _logger().debug("SpecDiff drafter warm-up: %.0f ms", 1000 * (time.perf_counter() - start))

    def _check_positions(self) -> None:
        """Fail at start-up when long requests could never be drafted for.

        Rows whose context + gamma passes the drafter's positions (or max_model_len) get
        shorter drafts in `propose`; but past the drafter's last position no draft fits at all,
        so without a context window the drafter must cover max_model_len positions, and with
        one, context_window + gamma of them.
        """
        limit = int(self.drafter.max_positions)
        window = self.config.context_window
        if window is None and self.max_model_len > limit:
            raise ValueError(
                f"the drafter supports {limit} positions but max_model_len is "
                f"{self.max_model_len}: lower --max-model-len to at most {limit} (drafts get "
                f"shorter within {self.gamma} tokens of it) or set "
                f"additional_config['specdiff']['context_window'] <= {limit - self.gamma}")
        if window is not None and window + self.gamma > limit:
            raise ValueError(
                f"additional_config['specdiff']['context_window'] = {window} plus "
                f"num_speculative_tokens = {self.gamma} exceeds the drafter's {limit} positions")

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None,
                **kwargs: Any) -> list[list[int]]:
        """One draft per row whose request just sampled tokens; [] for the others.

        token_ids_cpu[i, :num_tokens_no_spec[i]] is row i's committed sequence (prompt plus
        output, the tokens sampled this step included).
        """
        if self.drafter is None:
            raise RuntimeError("SpecDiffProposer.propose called before load_model")
        start = self.clock()
        num_rows = len(sampled_token_ids)
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        self.last_tries = [None] * num_rows
        decoded: list[_Row] = []
        accepted, depths, from_lookup = [], [], []
        verified: int | None = 0  # verifier tokens of this step; None: it also prefilled
        arrived = 0  # rows that are new this step
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:
                verified = None  # partial prefill chunk or discarded request: nothing to extend
                continue
            n = int(num_tokens_no_spec[i])
            context = token_ids_cpu[i, :n]
            same = self._pending.get(self._signature(context[: n - len(sampled)]))
            prev = same.pop() if same else None
            if prev is None:
                verified = None  # a new or resumed request: this step ran its prefill
                arrived += 1
            else:
                verified = None if verified is None else verified + 1 + prev.tokens
                if prev.depth:
                    accepted.append(min(len(sampled) - 1, prev.depth))
                    depths.append(prev.depth)
                    from_lookup.append(prev.lookup)
            room = min(self.gamma, self.max_model_len - n, self.drafter.draft_room(n))
            decoded.append(_Row(i, np.asarray(context), max(room, 0),
                                0 if prev is None else prev.drafted_upto,
                                n if prev is None else prev.start))
        departed = sum(len(left) for left in self._pending.values())
        self._pending.clear()  # rows not seen this step finished or were preempted
        if self.adaptive is not None:
            self.adaptive.observe_rows(len(decoded) - arrived, departed, arrived)
        self._record_accepted(accepted, depths, from_lookup)
        found, retrieved = self._lookups(decoded)
        lengths = self._draft_lengths(decoded, start, verified, found)
        by_lookup = {row.index for row, n in zip(decoded, lengths, strict=True)
                     if n and row.index in found}
        rows = []
        for row, length in zip(decoded, lengths, strict=True):
            if row.index in by_lookup:
                drafts[row.index] = found[row.index][:length].tolist()
            elif length:
                rows.append((row, length))
        encoded = 0
        drafter_rows: set[int] = set()
        if rows:
            allowed = [self.tree_rows is None or bool(self.tree_rows[r.index]) for r, _ in rows]
            contexts = [torch.from_numpy(np.asarray(r.context, dtype=np.int64)) for r, _ in rows]
            tokens, tries = self._draft(contexts, [n for _, n in rows], allowed)
            for (row, n), draft, trie in zip(rows, tokens, tries, strict=True):
                drafts[row.index] = draft
                self.last_tries[row.index] = trie
                encoded += self._encoded(row) + n
                drafter_rows.add(row.index)
            self._observe_full_tokens(drafts, rows)
        for row, length in zip(decoded, lengths, strict=True):
            n = int(row.context.shape[0])
            # a lookup draft may be shorter than its length; a trie has more nodes than depth
            depth = min(length, len(drafts[row.index]))
            self._pending.setdefault(self._signature(row.context), []).append(_Pending(
                depth, len(drafts[row.index]),
                n if row.index in drafter_rows else row.drafted_upto, row.start,
                lookup=row.index in by_lookup))
        elapsed = self.clock() - start
        self._observe_call(encoded, elapsed)
        with self._lock:
            self.propose_calls += 1
            self.drafted_rows += sum(1 for n in lengths if n)  # by the drafter or by lookup
            self.lookup_drafts += len(by_lookup)
            self.datastore_drafts += len(by_lookup & retrieved)
            self.drafter_seconds += elapsed
        self._maybe_log()
        return drafts

    # ---- adaptive drafting ----------------------------------------------------------------------
    def _lookups(self, decoded: list[_Row]) -> tuple[dict[int, np.ndarray], set[int]]:
        """With prompt lookup on: per batch index, the lookup continuation (at most the row's
        room) of each row whose context repeats, else (with a datastore) the retrieved one;
        and the batch indices whose continuation was retrieved."""
        out: dict[int, np.ndarray] = {}
        retrieved: set[int] = set()
        if not self.lookup_enabled:
            return out, retrieved
        rows = [row for row in decoded if row.room > 0]
        found = lookup_continuations([row.context for row in rows], [row.room for row in rows])
        for row, continuation in zip(rows, found, strict=True):
            if (continuation is None or not continuation.shape[0]) and self.datastore is not None:
                continuation = self.datastore.draft(row.context, row.room)
                if continuation is not None:
                    retrieved.add(row.index)
            if continuation is not None and continuation.shape[0] > 0:
                out[row.index] = continuation
        return out, retrieved

    def _draft_lengths(self, decoded: list[_Row], start: float, verified: int | None,
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

    def _encoded(self, row: _Row) -> int:
        """Context tokens the drafter encodes for this row before drafting (its KV pool holds
        the context it last drafted from; a skipped step leaves one more token to catch up)."""
        fresh = int(row.context.shape[0]) - row.drafted_upto
        window = self.config.context_window
        return fresh if window is None else min(fresh, window)

    def _observe_full_tokens(self, drafts: list[list[int]], rows: list[tuple[_Row, int]]
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

    def _record_accepted(self, accepted: list[int], depths: list[int],
                         from_lookup: list[bool]) -> None:
        """Accepted draft tokens per row, recorded out of each row's own draft length (and, for
        the controller, by the draft's source)."""
        for depth in sorted(set(depths)):
            self.stats.record([a for a, d in zip(accepted, depths, strict=True) if d == depth],
                              depth)
        if self.adaptive is not None and accepted:
            self.adaptive.observe_accepted(accepted, depths, from_lookup)

    def _draft(self, contexts: list[torch.Tensor], lengths: list[int], allowed: list[bool]
               ) -> tuple[list[list[int]], list[RequestTrie | None]]:
        """The drafter's `lengths[j]` draft tokens for context j. Rows near the position limit
        get shorter drafts than gamma; the drafter runs once per distinct length (once, away
        from it). With K > 1 a full-length row the runner allows (`allowed[j]`) gets a trie of K
        candidates instead."""
        out: list[list[int]] = [[] for _ in contexts]
        tries: list[RequestTrie | None] = [None] * len(contexts)
        for length in sorted(set(lengths), reverse=True):
            group = [j for j, n in enumerate(lengths) if n == length]
            logits = self.drafter.draft_logits([contexts[j] for j in group], length,
                                               steps=min(self.config.steps, length))
            if self.config.num_drafts > 1:
                self._tree_drafts(logits, group, contexts, allowed, out, tries)
                continue
            if self.config.drafter_temperature == 0:  # argmax drafts: skip one-hot marginals over V
                tokens = logits.argmax(-1).tolist()
            else:
                marginals = draft_marginals(logits, self.config.drafter_temperature,
                                            self.config.top_k)
                tokens = sample_drafts(marginals, 1, generator=self.generator)[:, 0].tolist()
            for j, draft in zip(group, tokens, strict=True):
                out[j] = draft
        return out, tries

    def _tree_drafts(self, logits: torch.Tensor, group: list[int], contexts: list[torch.Tensor],
                     allowed: list[bool], out: list[list[int]], tries: list[RequestTrie | None]
                     ) -> None:
        """K candidates per row merged into a trie (rows the runner allows, with a full window and
        room for the trie); other rows get the argmax draft, verified by vLLM as a chain."""
        full = logits.shape[1] == self.gamma
        candidates = candidate_drafts(logits, self.config.num_drafts if full else 1,
                                      self.config.drafter_temperature, self.config.top_k,
                                      self.generator)
        for r, j in enumerate(group):
            context = contexts[j]
            budget = min(self.config.max_tree_tokens,
                         self.max_model_len - int(context.shape[0]) + 1)
            if not (full and allowed[j] and budget >= self.gamma + 1):
                out[j] = candidates[r, 0].tolist()
                continue
            row_drafts, sources = self._with_ngram(context, candidates[r])
            trie = build_request_trie(int(context[-1]), row_drafts, budget, sources)
            tries[j] = trie
            out[j] = trie.draft_tokens()

    def _with_ngram(self, context: torch.Tensor, drafts: torch.Tensor
                    ) -> tuple[torch.Tensor, tuple[str, ...]]:
        """With "ngram" among the candidates, a prompt-lookup match replaces candidate 1 (kept
        first when the node budget drops candidates); without a match all stay samples."""
        sources = ("argmax",) + ("sample",) * (drafts.shape[0] - 1)
        if "ngram" not in self.config.candidates:
            return drafts, sources
        found = ngram_draft(context.numpy(), self.gamma, drafts[0])
        if found is None:
            return drafts, sources
        drafts = drafts.clone()
        drafts[1] = found
        return drafts, ("argmax", "ngram") + sources[2:]

    def record_tree_steps(self, accepted: list[int], selected: list[int], sources: list[str],
                          tau_chosen: list[float], tau_mean: list[float], walked: int = 0,
                          several_tried: int = 0) -> None:
        """The runner reports its trie verify steps: accepted length, k*, the source of k*, tau of
        k* and the mean tau of all candidates (per request); with selection "tree", how many of
        them the tree walk committed and how many of those tried several children at a node."""
        with self._lock:
            self.tree_walks += walked
            self.tree_walks_several += several_tried
            self.tree_stats.record(accepted, self.gamma, selected, self.config.num_drafts)
            for source in sources:
                self.chosen_sources[source] = self.chosen_sources.get(source, 0) + 1
            self.tau_chosen += sum(tau_chosen)
            self.tau_all += sum(tau_mean)

    # ---- metrics --------------------------------------------------------------------------------
    @staticmethod
    def _signature(context: np.ndarray) -> tuple[int, bytes]:
        tail = np.asarray(context[-_SIGNATURE_TOKENS:], dtype=np.int64)
        return int(context.shape[0]), tail.tobytes()

    def _new_stats(self) -> SpecDecodeStats:
        stats = SpecDecodeStats()
        stats.record([], self.gamma)  # size the per-position lists for gamma, whatever is drafted
        return stats

    def get_stats(self) -> dict[str, Any]:
        """Drafter time per step and acceptance, as the Python API and log line report them."""
        with self._lock:
            calls, rows, seconds = self.propose_calls, self.drafted_rows, self.drafter_seconds
            lookups, retrieved = self.lookup_drafts, self.datastore_drafts
            adaptive = {"enabled": False} if self.adaptive is None else self.adaptive.stats()
        out = {
            "gamma": self.gamma,
            "drafter": self.drafter_path,
            "propose_calls": calls,
            "drafted_rows": rows,
            "lookup_drafts": lookups,
            "datastore_drafts": retrieved,
            "drafter_seconds": seconds,
            "drafter_ms_per_step": 1000.0 * seconds / calls if calls else 0.0,
            "mean_accepted_length": self.stats.mean_accepted_length,
            "acceptance_rate": self.stats.acceptance_rate,
            "per_position_acceptance": self.stats.per_position_acceptance,
            "accepted_length_histogram": list(self.stats.accepted_length_histogram),
            "verify_steps": self.stats.steps,
            "drafted_tokens": self.stats.drafted_tokens,
            "adaptive": adaptive,
        }
        if self.config.num_drafts > 1:
            steps = self.tree_stats.steps
            out["tree"] = {**self.tree_stats.to_dict(),
                           "chosen_sources": dict(self.chosen_sources),
                           "mean_tau_chosen": self.tau_chosen / steps if steps else 0.0,
                           "mean_tau_all": self.tau_all / steps if steps else 0.0,
                           "tree_walk_steps": self.tree_walks,
                           "tree_walk_steps_trying_several_children": self.tree_walks_several}
        if self.drafter is not None:
            out["drafter_cache"] = self.drafter.cache_stats()
            out["quantization"] = self.drafter.quantization
        return out

    def reset_stats(self) -> None:
        with self._lock:
            self.stats = self._new_stats()
            if self.adaptive is not None:
                self.adaptive.reset_counters()
            self.propose_calls = 0
            self.drafted_rows = 0
            self.lookup_drafts = 0
            self.datastore_drafts = 0
            self.drafter_seconds = 0.0
            self._logged = (0, 0.0, 0)
            self.tree_stats = SpecDecodeStats()
            self.chosen_sources = {}
            self.tau_chosen = self.tau_all = 0.0
            self.tree_walks = self.tree_walks_several = 0

    def _maybe_log(self) -> None:
        interval = self.config.log_interval
        now = time.monotonic()
        if interval <= 0 or now - self._last_log < interval:
            return
        self._last_log = now
        calls, seconds, steps = self.propose_calls, self.drafter_seconds, self.stats.steps
        d_calls = calls - self._logged[0]
        d_secs = seconds - self._logged[1]
        self._logged = (calls, seconds, steps)
        _logger().info(
            "SpecDiff drafter: %.1f ms/step (last %d steps), mean accepted length %.2f of %d "
            "(%d verify steps), cache %s",
            1000.0 * d_secs / max(d_calls, 1), d_calls, self.stats.mean_accepted_length,
            self.gamma, steps, self.drafter.cache_stats() if self.drafter is not None else {})
        if self.config.num_drafts > 1:
            tree = self.tree_stats
            _logger().info(
                "SpecDiff self-selection (K=%d): %d trie steps, mean accepted length %.2f, "
                "chosen %s, mean tau chosen %.2f vs all %.2f", self.config.num_drafts,
                tree.steps,
                tree.mean_accepted_length, self.chosen_sources,
                self.tau_chosen / max(tree.steps, 1), self.tau_all / max(tree.steps, 1))
        if self.adaptive is not None:
            _logger().info("SpecDiff adaptive drafting: %s", self.adaptive.summary())
