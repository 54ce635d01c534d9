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

from vllm_specdiff.adaptive import AdaptiveDrafting, ShapeChoice
from vllm_specdiff.core import SpecDecodeStats, draft_marginals, sample_drafts
from vllm_specdiff.core.candidates import candidate_drafts, lookup_continuations, ngram_draft
from vllm_specdiff.core.datastore import Datastore
from vllm_specdiff.core.trie import RequestTrie, best_first_drafts, build_request_trie
from vllm_specdiff.plugin.config import (
    SpecDiffConfig,
    check_drafter_for,
    check_num_speculative_tokens,
    parse_specdiff_config,
)
from vllm_specdiff.plugin.proposer_adaptive import AdaptiveLengths
from vllm_specdiff.plugin.proposer_conditioned import ConditionedContexts
from vllm_specdiff.plugin.proposer_rows import (
    Pending,
    Row,
    StepRows,
    match_rows,
    remember,
)
from vllm_specdiff.plugin.proposer_stats import ProposerStats, specdiff_logger
from vllm_specdiff.plugin.vllm_plugin import install_vllm_fixes
from vllm_specdiff.plugin.workers import (
    RunnerSupport,
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
        # best-first trees: whether a step drafts the tree or the chain, measured (adaptive)
        self.shape_choice = ShapeChoice() if self.config.best_first and self.config.adaptive \
            else None
        self._shape = "tree"
        self._shape_step: tuple[str, float] | None = None  # last step's shape, its seconds
        self._lock = threading.Lock()
        self._last_log = time.monotonic()
        self._logged = (0, 0.0, 0)
        # What the model runner serves (`attach_runner`; vLLM's own runner: neither tries nor
        # the verifier's states). A tree-verifying one says per step which rows may get a trie
        # (`set_tree_rows`; the others get a chain) and reads back each row's (`take_tries`).
        self.runner_support = RunnerSupport()
        self._tree_rows: np.ndarray | None = None
        self._tries: list[RequestTrie | None] = []
        self.tree_stats = SpecDecodeStats()
        self.chosen_sources: dict[str, int] = {}
        self.tau_chosen = 0.0
        self.tau_all = 0.0
        self.tree_walks = self.tree_walks_several = 0  # selection "tree": walked steps
        # A drafter that reads the verifier: its runner (conditioned_runner.py) captures the
        # layers of `verifier_taps()` and feeds each request's committed states.
        self.contexts = None
        self._row_requests: list[str] = []

    # ---- the runner's hand-off ------------------------------------------------------------------
    def attach_runner(self, support: RunnerSupport) -> None:
        """Once, before `load_model`, from the SpecDiff model runner vLLM built this proposer in
        (`tree_runner.SpecDiffRunner`): what that runner serves. `load_model` refuses a
        configuration it cannot serve, naming the worker that can."""
        if self.drafter is not None:
            raise RuntimeError("SpecDiffProposer.attach_runner called after load_model")
        self.runner_support = support

    def set_tree_rows(self, rows: np.ndarray) -> None:
        """Before a step's `propose` (tree-verifying runner): per batch row, whether its request
        may be verified as a trie; the other rows get a chain. Holds for that call only."""
        self._tree_rows = np.asarray(rows, dtype=bool)

    def take_tries(self) -> list[RequestTrie | None]:
        """After a step's `propose` (tree-verifying runner): per batch row, the trie whose nodes
        are its draft tokens (None: a chain, or no draft); each step's are handed over once."""
        tries, self._tries = self._tries, []
        return tries

    # ---- vLLM interface -------------------------------------------------------------------------
    def load_model(self, target_model: Any = None, *args: Any, **kwargs: Any) -> None:
        """Load the drafter next to the verifier (vLLM calls this after loading the target)."""
        from vllm_specdiff.drafter import load_drafter

        if self.config.verifies_trees and not self.runner_support.trees:
            # a conditioned drafter's tree worker also captures the verifier's states
            worker = conditioned_tree_worker() if reads_verifier(self.config.drafter) \
                else tree_worker()
            option, value = ("best_first", "true") if self.config.best_first \
                else ("num_drafts", self.config.num_drafts)
            raise ValueError(f"additional_config['specdiff']['{option}'] = {value} needs the "
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
        if conditioned and not self.runner_support.features:
            worker = conditioned_tree_worker() if self.config.verifies_trees \
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
        if conditioned and self.gamma > self.drafter.cfg.gamma and not self.config.best_first:
            raise ValueError(f"num_speculative_tokens = {self.gamma} exceeds the block of the "
                             f"conditioned drafter {path} ({self.drafter.cfg.gamma} draft "
                             "tokens per forward)")
        # positions one forward drafts: gamma, but a best-first tree's gamma nodes stop at a
        # conditioned drafter's block (a chain's gamma was checked to fit it above)
        self.draft_depth = min(self.gamma, self.drafter.cfg.gamma) if conditioned else self.gamma
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
        output, the tokens sampled this step included). Five steps: match the rows to what the
        last step left (`match_rows`, whose outcome the controller observes), look up
        continuations, plan each row's length (`_draft_lengths`), draft (`_fill_drafts`) and
        remember what the next step needs (`remember`).
        """
        if self.drafter is None:
            raise RuntimeError("SpecDiffProposer.propose called before load_model")
        start = self.clock()
        tree_rows, self._tree_rows = self._tree_rows, None
        step = match_rows(self._pending, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                          self._room)
        self._observe_step(step, sum(len(s) for s in sampled_token_ids), start)
        found, retrieved = self._lookups(step.decoded)
        lengths = self._draft_lengths(step.decoded, start, step.verified, found)
        drafts, by_lookup, drafter_rows, encoded = self._fill_drafts(
            step.decoded, lengths, found, tree_rows, len(sampled_token_ids))
        remember(self._pending, step.decoded, lengths, drafts, drafter_rows, by_lookup)
        elapsed = self.clock() - start
        self._shape_step = (self._shape, elapsed) if drafter_rows else None
        self._observe_call(encoded, elapsed)
        self._count_step(sum(1 for n in lengths if n), len(by_lookup),
                         len(by_lookup & retrieved), bool(drafter_rows), elapsed)
        self._maybe_log()
        return drafts

    def _room(self, n: int) -> int:
        """The most draft tokens after a context of n tokens (gamma, max_model_len and the
        drafter's positions)."""
        return min(self.gamma, self.max_model_len - n, self.drafter.draft_room(n))

    def _observe_step(self, step: StepRows, committed: int, start: float) -> None:
        """What the verifier step that just ran tells the controller: rows that arrived and
        departed, accepted counts, and (best-first trees) the committed tokens of its shape."""
        if self.adaptive is not None:
            self.adaptive.observe_rows(len(step.decoded) - step.arrived, step.departed,
                                       step.arrived)
        self._record_accepted(step.accepted, step.depths, step.from_lookup)
        self._observe_shape(committed, start, step.verified)

    def _fill_drafts(self, decoded: list[Row], lengths: list[int],
                     found: dict[int, np.ndarray], tree_rows: np.ndarray | None, num_rows: int
                     ) -> tuple[list[list[int]], set[int], set[int], int]:
        """Step 4 of `propose`: each row's draft, the lookup continuation where its length
        went to one, else the drafter's (a trie where the runner allows one). Returns the
        drafts, the rows drafted by lookup and by the drafter, and the tokens it encoded."""
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        self._tries = [None] * num_rows
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
        if not rows:
            return drafts, by_lookup, drafter_rows, encoded
        self._shape = self._shape_now()
        allowed = [tree_rows is None or bool(tree_rows[r.index]) for r, _ in rows]
        contexts = [torch.from_numpy(np.asarray(r.context, dtype=np.int64)) for r, _ in rows]
        tokens, tries = self._draft(contexts, [n for _, n in rows], allowed,
                                    [r.index for r, _ in rows])
        for (row, n), draft, trie in zip(rows, tokens, tries, strict=True):
            drafts[row.index] = draft
            self._tries[row.index] = trie
            encoded += self._encoded(row) + n
            drafter_rows.add(row.index)
        self._observe_full_tokens(drafts, rows)
        return drafts, by_lookup, drafter_rows, encoded

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
            # a draft reaches at most draft_depth positions (a best-first tree of `length`
            # nodes goes no deeper than the drafter's block; a chain's length is within it)
            window = min(length, self.draft_depth)
            if self.contexts is not None:
                logits = self._conditioned_logits([contexts[j] for j in group],
                                                  [indices[j] for j in group], window)
            else:
                logits = self.drafter.draft_logits([contexts[j] for j in group], window,
                                                   steps=min(self.config.steps, window))
            if self.config.best_first:  # trees where the runner allows and the shape pays
                tree = self._shape == "tree"
                drafted = best_first_drafts(logits, [int(contexts[j][-1]) for j in group],
                                            [tree and allowed[j] for j in group], length)
                for j, (draft, trie) in zip(group, drafted, strict=True):
                    out[j], tries[j] = draft, trie
                continue
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
