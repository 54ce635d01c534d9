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
Beside this module: what a row carries between steps (`proposer_rows`), the adaptive
controller's side (`proposer_adaptive`), a drafter that reads the verifier
(`proposer_conditioned`) and the statistics (`proposer_stats`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm_specdiff.adaptive import AdaptiveDrafting
from vllm_specdiff.core import SpecDecodeStats, draft_marginals, sample_drafts
from vllm_specdiff.core.candidates import candidate_drafts, lookup_continuations, ngram_draft
from vllm_specdiff.core.datastore import Datastore
from vllm_specdiff.core.trie import RequestTrie, build_request_trie
from vllm_specdiff.plugin.config import (
    SpecDiffConfig,
    check_drafter_for,
    check_num_speculative_tokens,
    parse_specdiff_config,
)
from vllm_specdiff.plugin.proposer_adaptive import AdaptiveLengths
from vllm_specdiff.plugin.proposer_conditioned import ConditionedContexts
from vllm_specdiff.plugin.proposer_rows import Pending, Row, signature
from vllm_specdiff.plugin.proposer_stats import ProposerStats, specdiff_logger
from vllm_specdiff.plugin.vllm_plugin import install_vllm_fixes
from vllm_specdiff.plugin.workers import (
    conditioned_tree_worker,
    conditioned_worker,
    reads_verifier,
    tree_worker,
)

WARM_UP_CONTEXT = 32  # tokens of the start-up draft's dummy context


def verifier_tokenizer(model_config: Any) -> Any:
    """vLLM's own tokenizer of the served model, whatever names it (a hub id, a local
    directory, a ModelScope id); None when vLLM skips tokenizer init. `model_config.tokenizer`
    is only a name, not necessarily a directory to read a vocabulary from."""
    from vllm.tokenizers import cached_tokenizer_from_config

    return cached_tokenizer_from_config(model_config)


class SpecDiffProposer(ConditionedContexts, AdaptiveLengths, ProposerStats):
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
        self.idle_steps, self.idle_seconds = 0, 0.0  # steps the drafter drafted no row in
        self._filed_seconds = 0.0  # this step's time filing the verifier's states
        # per context signature, one entry per row (rows with identical contexts, e.g. greedy
        # n > 1, each keep theirs)
        self._pending: dict[tuple[int, bytes], list[Pending]] = {}
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
        # A drafter that reads the verifier (conditioned_runner.py): the runner marks itself
        # (feature_runner), captures `feature_taps` and feeds each request's committed states.
        self.feature_runner = False
        self.feature_taps: tuple[int, ...] = ()
        self.contexts = None
        self._row_requests: list[str] = []

    # ---- vLLM interface -------------------------------------------------------------------------
    def load_model(self, target_model: Any = None, *args: Any, **kwargs: Any) -> None:
        """Load the drafter next to the verifier (vLLM calls this after loading the target)."""
        from vllm_specdiff.drafter import load_drafter

        if self.config.num_drafts > 1 and not self.trees_enabled:
            # a conditioned drafter's tree worker also captures the verifier's states
            worker = conditioned_tree_worker() if reads_verifier(self.config.drafter) \
                else tree_worker()
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
        conditioned = reads_verifier(path)
        if conditioned and not self.feature_runner:
            worker = conditioned_tree_worker() if self.config.num_drafts > 1 \
                else conditioned_worker()
            raise ValueError(f"the drafter {path} reads the verifier's hidden states and needs "
                             f"the worker that captures them: add worker_cls={worker!r} "
                             f"(--worker-cls {worker}; specdiff_engine_args and vllm-specdiff "
                             "serve/generate/bench add it)")
        self.drafter = load_drafter(
            path, lora=self.config.lora, dtype=dtype, device=device,
            context_window=self.config.context_window,
            verifier_vocab_size=self.verifier_vocab_size, cache_size=self.cache_size,
            verifier_tokenizer=verifier_tokenizer(self.model_config),
            cache_bytes=self.config.cache_bytes, quantize=self.config.quantize,
            verifier=str(self.model_config.model))
        if conditioned and self.gamma > self.drafter.cfg.gamma:
            raise ValueError(f"num_speculative_tokens = {self.gamma} exceeds the block of the "
                             f"conditioned drafter {path} ({self.drafter.cfg.gamma} draft "
                             "tokens per forward)")
        if conditioned:
            self._load_contexts()
        self._check_positions()
        self._warm_up()
        self.drafter_path = path
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(self.config.seed)
        specdiff_logger().info(
            "SpecDiff drafter %s loaded (gamma=%d, T_d=%s, steps=%d, cache=%d)", path,
            self.gamma, self.config.drafter_temperature, self.config.steps, self.cache_size)

    def _warm_up(self) -> None:
        """One throwaway draft before serving. The drafter's first call pays one-time costs
        (kernel and allocator set-up: 0.5-11 s measured inside the engine, then a few ms per
        call) that would otherwise land in the first request's latency and, with adaptive
        drafting, in the drafter cost model, which then judges drafting too dear to try."""
        context = torch.zeros(min(WARM_UP_CONTEXT, self.drafter.max_positions - self.gamma),
                              dtype=torch.long)
        start = time.perf_counter()
        with torch.inference_mode():
            if self.contexts is not None:
                self._warm_up_contexts(context)
            else:
                self.drafter.draft_logits([context], self.gamma,
                                          steps=min(self.config.steps, self.gamma))
        self.drafter.clear_cache()  # the dummy context must not sit in the KV pool
        specdiff_logger().debug("SpecDiff drafter warm-up: %.0f ms",
                                1000 * (time.perf_counter() - start))

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
        decoded: list[Row] = []
        accepted, depths, from_lookup = [], [], []
        verified: int | None = 0  # verifier tokens of this step; None: it also prefilled
        arrived = 0  # rows that are new this step
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:
                verified = None  # partial prefill chunk or discarded request: nothing to extend
                continue
            n = int(num_tokens_no_spec[i])
            context = token_ids_cpu[i, :n]
            same = self._pending.get(signature(context[: n - len(sampled)]))
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
            decoded.append(Row(i, np.asarray(context), max(room, 0),
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
            tokens, tries = self._draft(contexts, [n for _, n in rows], allowed,
                                        [r.index for r, _ in rows])
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
            self._pending.setdefault(signature(row.context), []).append(Pending(
                depth, len(drafts[row.index]),
                n if row.index in drafter_rows else row.drafted_upto, row.start,
                lookup=row.index in by_lookup))
        elapsed = self.clock() - start
        self._observe_call(encoded, elapsed)
        self._count_step(sum(1 for n in lengths if n), len(by_lookup),
                         len(by_lookup & retrieved), bool(drafter_rows), elapsed)
        self._maybe_log()
        return drafts

    # ---- drafting -------------------------------------------------------------------------------
    def _lookups(self, decoded: list[Row]) -> tuple[dict[int, np.ndarray], set[int]]:
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

    def _draft(self, contexts: list[torch.Tensor], lengths: list[int], allowed: list[bool],
               indices: list[int]) -> tuple[list[list[int]], list[RequestTrie | None]]:
        """The drafter's `lengths[j]` draft tokens for context j. Rows near the position limit
        get shorter drafts than gamma; the drafter runs once per distinct length (once, away
        from it). With K > 1 a full-length row the runner allows (`allowed[j]`) gets a trie of K
        candidates instead."""
        out: list[list[int]] = [[] for _ in contexts]
        tries: list[RequestTrie | None] = [None] * len(contexts)
        self._catch_up(indices)
        for length in sorted(set(lengths), reverse=True):
            group = [j for j, n in enumerate(lengths) if n == length]
            if self.contexts is not None:
                logits = self._conditioned_logits([contexts[j] for j in group],
                                                  [indices[j] for j in group], length)
            else:
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
