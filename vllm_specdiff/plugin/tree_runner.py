"""Self-selection inside vLLM: K candidate drafts verified in one tree-masked forward.

vLLM 0.32 verifies one chain of draft tokens per request. `TreeVerificationRunner`, mixed into
vLLM's model runner by the platform's worker module (`workers_cpu.SpecDiffCPUWorker`,
`workers_cuda.SpecDiffGPUWorker`), lets the proposer send a trie of K candidates instead:

1. the trie's nodes travel as the request's draft tokens, so vLLM schedules them, gives every node
   a KV slot (linear slot order) and a logits row;
2. `_prepare_inputs` overrides the nodes' positions (context length + depth) and hands their
   ancestor masks to the tree-mask attention wrapper (`tree_attention`) for the forward;
3. `_sample` scores the candidates from the node logits (core `score_drafts`), picks k*, and hands
   vLLM's own rejection sampler the chain [root, path of k*] with its logits rows, so the commit
   follows vLLM's sampling semantics exactly (point mass, greedy, seeds, bonus token, logprobs);
   with selection "tree", requests the walk serves exactly (`tree_rule_eligible`) are then
   recommitted with the multi-candidate tree walk (`_walk_trees`, core `verify_tree`);
4. the KV entries of the accepted path are copied to the request's canonical slots; the slots
   past the committed length are overwritten by later steps, as with plain speculative decoding.

Requests whose drafts are a plain chain (K = 1 rows, fallbacks, truncated tries) take vLLM's
native path untouched. The hand-off with the proposer is typed: at start-up `SpecDiffRunner`
passes it the runner's `workers.RunnerSupport`; each step the runner says which rows may get a
trie (`SpecDiffProposer.set_tree_rows`) and reads back the tries drafted (`take_tries`). A
drafter that reads the verifier's hidden states (the default drafter does) gets them from
`conditioned_runner.ConditionedRunner`, mixed in before this one (`ConditionedTreeRunner`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from vllm_specdiff.core import Verdict, score_drafts, target_probs, verify_tree
from vllm_specdiff.core.scoring import streak_within
from vllm_specdiff.core.trie import RequestTrie
from vllm_specdiff.plugin.proposer import SpecDiffProposer
from vllm_specdiff.plugin.tree_attention import CacheLayout, TreeBatchContext, TreeRequest
from vllm_specdiff.plugin.vllm_plugin import clamp_spec_decode_stats
from vllm_specdiff.plugin.workers import RunnerSupport

logger = init_logger("vllm.specdiff")
_SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class StepTrie:
    """A trie scheduled in this step: where its rows are and the KV slot of each node."""

    trie: RequestTrie
    batch_index: int
    slots: torch.Tensor


@dataclass(frozen=True)
class Selection:
    """The committed candidate of one request: k (k* of the tau rule; for the tree walk the
    lowest candidate holding the accepted path), its trie nodes (for the walk: the accepted
    ones), the tau of every candidate, and for the walk whether a node tried several children."""

    k: int
    source: str
    path: torch.Tensor
    taus: torch.Tensor
    walked: bool = False
    several_tried: bool = False

    @property
    def tau(self) -> float:
        return float(self.taus[self.k])

    @property
    def tau_mean(self) -> float:
        return float(self.taus.mean())


def tree_eligible(params: Any) -> bool:
    """Whether a request may be verified as a trie: features that assume vLLM's own chain of
    drafts (penalties and bad words read the drafts as output history, structured output
    validates them as a sequence) fall back to one argmax draft."""
    if params is None:
        return False
    return (params.presence_penalty == 0 and params.frequency_penalty == 0
            and params.repetition_penalty == 1 and not params.bad_words
            and getattr(params, "structured_outputs", None) is None)


def tree_rule_eligible(params: Any) -> bool:
    """Whether the tree walk (selection "tree") commits this request exactly as vLLM would
    sample it. The walk applies temperature, top-k, top-p and the request's seed; what else
    vLLM's rejection sampler honours needs its chain: sample logprobs (and logprob_token_ids)
    are read off the chain's rows, allowed_token_ids and min_tokens mask the drafts' rows,
    min_p and logit_bias shape the bonus token, the thinking budget tracks the drafts. Such
    requests commit the tau-selected chain through vLLM's rejection sampler."""
    return (params.logprobs is None and not params.logprob_token_ids
            and not params.allowed_token_ids and params.min_tokens == 0
            and params.min_p == 0 and not params.logit_bias
            and params.thinking_token_budget is None)


def walk_candidate(trie: RequestTrie, nodes: torch.Tensor) -> int:
    """The lowest candidate whose path starts with the walk's accepted nodes (nothing accepted:
    0). A trie the scheduler cut may hold a branch of a dropped candidate; then the candidate
    sharing the longest prefix with the walk."""
    count = int(nodes.shape[0])
    if count == 0:
        return 0
    shared = (trie.draft_nodes[:, :count] == nodes.to(trie.draft_nodes)).long().cumprod(dim=1)
    return int(shared.sum(dim=1).argmax())  # argmax: the first maximum, i.e. the lowest k


def tried_several_children(trie: RequestTrie, nodes: torch.Tensor) -> bool:
    """Whether the walk along [root, nodes] tried more than one child at some node: it accepted
    a child that is not its parent's first, or rejected all of at least two at its last node
    (children are tried in node order, as `verify_tree` does)."""
    parents = trie.parents.tolist()
    path = [0, *nodes.tolist()]
    for depth, node in enumerate(path):
        children = [c for c, parent in enumerate(parents) if parent == node]
        if depth + 1 < len(path):
            if children.index(path[depth + 1]) > 0:
                return True
        elif len(children) > 1:
            return True
    return False


def _custom_logits_processors(logitsprocs: Any) -> bool:
    """Whether the engine loaded logits processors beyond vLLM's built-in ones (min_p,
    logit_bias, min_tokens, which `tree_rule_eligible` checks per request): the walk cannot
    apply them, so selection "tree" then commits every trie as "tau"."""
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor,
        MinPLogitsProcessor,
        MinTokensLogitsProcessor,
    )

    builtin = (LogitBiasLogitsProcessor, MinPLogitsProcessor, MinTokensLogitsProcessor)
    return any(not isinstance(proc, builtin) for proc in logitsprocs.all)


def _filters(params: Any, vocab: int) -> tuple[float, int | None, float | None]:
    temperature = float(params.temperature)
    if temperature < _SAMPLING_EPS:
        return 0.0, None, None
    top_k = int(params.top_k) if 0 < int(params.top_k) < vocab else None
    top_p = float(params.top_p) if float(params.top_p) < 1.0 else None
    return temperature, top_k, top_p


def select_candidate(trie: RequestTrie, node_logits: torch.Tensor, params: Any
                     ) -> tuple[int, torch.Tensor]:
    """k* and tau [K]: the candidate with the highest expected accepted length under the request's
    own sampling settings (ties: lowest k, so the argmax draft wins ties)."""
    temperature, top_k, top_p = _filters(params, node_logits.shape[-1])
    scores = score_drafts(node_logits.float(), trie.token_tree(), temperature, top_k, top_p)
    if trie.lengths is None:
        return int(scores.selected[0]), scores.tau[0]
    tau = streak_within(scores.log_a[0], trie.lengths)
    return int(tau.argmax()), tau  # argmax: the first maximum, i.e. the lowest k


def chain_metadata(draft_lists: list[list[int]], device: torch.device) -> SpecDecodeMetadata:
    """SpecDecodeMetadata for logits laid out request after request, [root, drafts...] each."""
    counts = np.array([len(d) for d in draft_lists], dtype=np.int32)
    sampled = counts + 1
    cu_sampled = np.cumsum(sampled, dtype=np.int32)
    starts = cu_sampled - sampled
    target = np.concatenate([s + np.arange(n, dtype=np.int32) for s, n in zip(starts, counts,
                                                                            strict=True)])
    flat = [t for d in draft_lists for t in d]
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor(flat, dtype=torch.int32, device=device),
        num_draft_tokens=counts.tolist(),
        cu_num_draft_tokens=torch.from_numpy(np.cumsum(counts, dtype=np.int32)).to(device),
        cu_num_sampled_tokens=torch.from_numpy(cu_sampled).to(device),
        target_logits_indices=torch.from_numpy(target.astype(np.int32)).to(device),
        bonus_logits_indices=torch.from_numpy(cu_sampled - 1).to(device),
        logits_indices=torch.arange(int(cu_sampled[-1]), dtype=torch.int32, device=device),
    )


def _walked_selection(trie: RequestTrie, verdict: Verdict, taus: torch.Tensor) -> Selection:
    """The Selection of a tree walk (one request): its accepted nodes, attributed to the lowest
    candidate holding them."""
    assert verdict.accepted_nodes is not None
    nodes = verdict.accepted_nodes[0, :int(verdict.num_accepted[0])].cpu()
    k = walk_candidate(trie, nodes)
    return Selection(k, trie.sources[k], nodes, taus, walked=True,
                     several_tried=tried_several_children(trie, nodes))


def _write_row(row: torch.Tensor, verdict: Verdict) -> None:
    """Overwrite one request's output row with the walk's tokens (accepted + emitted)."""
    count = int(verdict.num_accepted[0]) + 1
    row.fill_(-1)
    row[:count] = verdict.tokens[0, :count].to(row)


class SpecDiffRunner:
    """Base of the runner mixins (`TreeVerificationRunner`, `conditioned_runner`'s): once vLLM's
    model runner has built the proposer (`self.drafter`, vLLM's name), hands it what this runner
    serves (`runner_support`), so that the proposer can refuse what it cannot."""

    runner_support: ClassVar[RunnerSupport] = RunnerSupport()

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        super().__init__(vllm_config, device)  # type: ignore[call-arg]
        drafter = getattr(self, "drafter", None)  # absent without speculative decoding
        if isinstance(drafter, SpecDiffProposer):
            drafter.attach_runner(self.runner_support)
        elif self.runner_support.trees:
            raise ValueError(f"{type(self).__name__} (tree verification, K > 1) needs "
                             "speculative_config.model = 'vllm_specdiff.SpecDiffProposer'")


class TreeVerificationRunner(SpecDiffRunner):
    """Trie verification for the SpecDiff proposer (K > 1), mixed into one of vLLM's model
    runners (`workers_cpu`, `workers_cuda`); the platform's part is `_install_tree_attention`."""

    runner_support = RunnerSupport(trees=True)
    drafter: SpecDiffProposer  # vLLM's attribute; `SpecDiffRunner` checked its class

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        if self.use_async_scheduling:
            raise ValueError("tree verification (K > 1) needs async scheduling off "
                             "(--no-async-scheduling / async_scheduling=False)")
        if self.uses_mrope:
            raise ValueError("tree verification (K > 1) does not support M-RoPE models")
        clamp_spec_decode_stats()  # also the general plugin's job; here for in-process engines
        self.tree_context = TreeBatchContext()
        self.tree_layout: CacheLayout | None = None
        self._tries: dict[str, RequestTrie] = {}
        self._step_tries: dict[str, StepTrie] = {}
        self._proposed = False

    # ---- set-up ---------------------------------------------------------------------------------
    def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> None:
        super().initialize_kv_cache(*args, **kwargs)
        if len(self.kv_cache_config.kv_cache_groups) != 1:
            raise ValueError("tree verification (K > 1) supports models with one KV cache group")
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        layers = get_layers_from_vllm_config(self.vllm_config, Attention)
        self.tree_layout = self._install_tree_attention(layers)
        self._kv_caches = list({id(layer.kv_cache): layer.kv_cache
                                for layer in layers.values()}.values())

    def _install_tree_attention(self, layers: dict[str, Any]) -> CacheLayout:
        """Wrap the attention layers with the tree-mask path; returns the KV cache layout."""
        raise NotImplementedError

    # ---- one step -------------------------------------------------------------------------------
    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray
                        ) -> Any:
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self._step_tries = {}
        requests = [req for req_id, spec in scheduler_output.scheduled_spec_decode_tokens.items()
                    if (req := self._schedule_trie(req_id, spec, num_scheduled_tokens))]
        self._tries = {}
        self.tree_context.set(requests)
        return out

    def _schedule_trie(self, req_id: str, spec: list[int], num_scheduled_tokens: np.ndarray
                       ) -> TreeRequest | None:
        """If this request's scheduled drafts are (a prefix of) its trie and not a plain chain:
        set the nodes' positions (context + depth), keep their slots; None otherwise."""
        trie = self._tries.get(req_id)
        i = self.input_batch.req_id_to_index.get(req_id)
        if trie is None or i is None:
            return None
        n = len(spec) + 1
        if int(num_scheduled_tokens[i]) != n or list(spec) != trie.draft_tokens()[: n - 1] \
                or trie.is_chain(n):
            return None
        trie = trie.truncated(n)
        start = int(self.query_start_loc.np[i])
        prefix = int(self.input_batch.num_computed_tokens_cpu[i])
        self.positions[start:start + n] = prefix + trie.depths
        slots = self.input_batch.block_table[0].slot_mapping.gpu[start:start + n].clone()
        self._step_tries[req_id] = StepTrie(trie, i, slots)
        return TreeRequest(start, n, prefix, i, trie.ancestor_mask())

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._model_forward(*args, **kwargs)
        finally:
            self.tree_context.clear()

    def _sample(self, logits: torch.Tensor | None, spec_decode_metadata: Any) -> Any:
        if spec_decode_metadata is None or not self._step_tries or logits is None:
            return super()._sample(logits, spec_decode_metadata)
        walk = self.drafter.config.walks_trees \
            and not _custom_logits_processors(self.input_batch.logitsprocs)
        walked = {i for i, r in enumerate(self.input_batch.req_ids)
                  if walk and r in self._step_tries
                  and tree_rule_eligible(self.requests[r].sampling_params)}
        rows, drafts, paths = self._select_chains(logits, spec_decode_metadata, walked)
        chain_logits = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
        metadata = chain_metadata(drafts, logits.device)
        sampling_metadata = self.input_batch.sampling_metadata
        if sampling_metadata.spec_token_ids is not None:
            sampling_metadata = replace(sampling_metadata, spec_token_ids=drafts)
        output = self.rejection_sampler(metadata, None, chain_logits, sampling_metadata)
        if walked:
            paths = self._walk_trees(logits, spec_decode_metadata, output.sampled_token_ids,
                                     paths, walked)
        self._commit_kv(output.sampled_token_ids, paths)
        self._step_tries = {}
        return output

    def _select_chains(self, logits: torch.Tensor, meta: SpecDecodeMetadata,
                       walked: set[int]
                       ) -> tuple[list[int], list[list[int]], dict[int, Selection]]:
        """Per request: its logits rows and drafts as a chain; tries contribute [root, path of
        k*]; a trie the walk will commit (batch index in `walked`) its deepest path instead,
        so that vLLM's output rows are wide enough for whatever the walk accepts. Returns
        (rows, drafts, {batch index: the selection})."""
        counts = meta.num_draft_tokens
        flat = meta.draft_token_ids.tolist()
        rows: list[int] = []
        drafts: list[list[int]] = []
        paths: dict[int, Selection] = {}
        start = draft_start = 0
        for i, n in enumerate(counts):
            step = self._step_tries.get(self.input_batch.req_ids[i])
            if step is None:
                rows.extend(range(start, start + n + 1))
                drafts.append(flat[draft_start:draft_start + n])
            else:
                params = self.requests[self.input_batch.req_ids[i]].sampling_params
                k, tau = select_candidate(step.trie, logits[start:start + n + 1], params)
                if i in walked and step.trie.lengths is not None:
                    k = int(step.trie.lengths.argmax())
                path = step.trie.path(k)
                paths[i] = Selection(k, step.trie.sources[k], path, tau.float().cpu())
                rows.append(start)
                rows.extend((start + path).tolist())
                drafts.append(step.trie.tokens[path].tolist())
            start += n + 1
            draft_start += n
        return rows, drafts, paths

    # The multi-candidate rule; a class attribute so a test can swap in a broken rule.
    tree_rule = staticmethod(verify_tree)

    def _walk_trees(self, logits: torch.Tensor, meta: SpecDecodeMetadata, sampled: torch.Tensor,
                    paths: dict[int, Selection], walk: set[int]) -> dict[int, Selection]:
        """Recommit the tries of `walk` (batch indices: `walks_trees` and `tree_rule_eligible`)
        with the tree walk over their node probabilities (the request's own temperature/top-k/
        top-p, its seeded generator), in place of the chain vLLM just verified: its row of
        `sampled` becomes the walk's tokens (-1 padded), so vLLM's counters and outputs see the
        committed path."""
        starts = np.cumsum([0, *(n + 1 for n in meta.num_draft_tokens)])
        generators = self.input_batch.sampling_metadata.generators
        walked = dict(paths)
        for i, chosen in paths.items():
            if i not in walk:
                continue
            req_id = self.input_batch.req_ids[i]
            params = self.requests[req_id].sampling_params
            trie = self._step_tries[req_id].trie
            node_logits = logits[int(starts[i]):int(starts[i + 1])]
            probs = target_probs(node_logits, *_filters(params, node_logits.shape[-1]))
            verdict = self.tree_rule(probs, trie.token_tree(), generators.get(i))
            walked[i] = _walked_selection(trie, verdict, chosen.taus)
            _write_row(sampled[i], verdict)
        return walked

    def _commit_kv(self, sampled: torch.Tensor, paths: dict[int, Selection]) -> None:
        """Copy the accepted nodes' KV to the canonical slots (depth j -> linear index j), and
        report the steps to the proposer's statistics."""
        assert self.tree_layout is not None
        src, dst = [], []
        valid = (sampled != -1).sum(dim=1) - 1
        accepted_all = []
        for i, chosen in paths.items():
            step = self._step_tries[self.input_batch.req_ids[i]]
            accepted = int(valid[i])
            accepted_all.append(accepted)
            for j in range(1, accepted + 1):
                node = int(chosen.path[j - 1])
                if node != j:
                    src.append(step.slots[node])
                    dst.append(step.slots[j])
        self.drafter.record_tree_steps(accepted_all, [c.k for c in paths.values()],
                                       [c.source for c in paths.values()],
                                       [c.tau for c in paths.values()],
                                       [c.tau_mean for c in paths.values()],
                                       walked=sum(c.walked for c in paths.values()),
                                       several_tried=sum(c.several_tried
                                                         for c in paths.values()))
        if not src:
            return
        src_t, dst_t = torch.stack(src), torch.stack(dst)
        for kv_cache in self._kv_caches:
            self.tree_layout.move(kv_cache, src_t, dst_t)

    # ---- proposing ------------------------------------------------------------------------------
    def propose_draft_token_ids(self, scheduler_output: Any, sampled_token_ids: Any,
                                *args: Any, **kwargs: Any) -> Any:
        req_ids = self.input_batch.req_ids
        self.drafter.set_tree_rows(np.array([
            tree_eligible(getattr(self.requests.get(r), "sampling_params", None))
            for r in req_ids], dtype=bool))
        drafts = super().propose_draft_token_ids(scheduler_output, sampled_token_ids, *args,
                                                 **kwargs)
        self._tries = {req_ids[i]: trie for i, trie in enumerate(self.drafter.take_tries())
                       if trie is not None and i < len(req_ids)}
        self._proposed = True
        return drafts

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        self._proposed = False
        out = super().sample_tokens(*args, **kwargs)
        if not self._proposed:
            self._tries = {}  # vLLM sent zero drafts (context near max_model_len) or none
        return out
