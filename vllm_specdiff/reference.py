"""A plain-transformers speculative decoding loop on top of the core: the correctness oracle.

Batch size 1 and no KV cache: every step re-runs the verifier over the whole context plus the
token tree with a 4D ancestor mask, so nothing engine-specific can hide a bug. The vLLM
integration is checked against this loop and training evaluation reuses it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from vllm_specdiff.core.acceptance import (
    Verdict,
    path_probs,
    verify_greedy,
    verify_point_mass,
    verify_standard,
    verify_tree,
)
from vllm_specdiff.core.metrics import SpecDecodeStats
from vllm_specdiff.core.sampling import draft_marginals, sample_drafts, target_probs
from vllm_specdiff.core.scoring import score_drafts
from vllm_specdiff.core.tree import TokenTree, build_token_tree

DrafterFn = Callable[[torch.Tensor, int], torch.Tensor]
"""(context LongTensor [L], gamma) -> drafter logits [gamma, V] over the verifier's vocabulary."""

Rule = Literal["point-mass", "tree", "standard"]
RULES: tuple[str, ...] = ("point-mass", "tree", "standard")


@dataclass
class GenerationResult:
    tokens: list[int]
    stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)


def _verifier_vocab(verifier: torch.nn.Module) -> int:
    return int(verifier.get_output_embeddings().weight.shape[0])


def tree_attention_inputs(context: torch.Tensor, tree: TokenTree, dtype: torch.dtype
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids [1, T], position_ids [1, T] and an additive 4D mask [1, 1, T, T] for one request.

    The context is causal; its last token is the tree's root; the other nodes follow, each
    attending to the whole context before the root and to its own ancestors (root included).
    """
    if tree.num_requests != 1:
        raise ValueError("the reference decoder handles one request at a time")
    length = context.shape[0]
    nodes = tree.tokens[1:].to(context.device)
    ids = torch.cat([context, nodes])
    positions = torch.cat([torch.arange(length, device=context.device),
                           length - 1 + tree.depths[1:].to(context.device)])
    total = ids.shape[0]
    allowed = torch.ones(total, total, device=context.device).tril().bool()
    tree_mask = tree.ancestor_mask()[0].to(context.device)
    start = length - 1
    allowed[start:, start:] = tree_mask
    additive = torch.zeros(total, total, dtype=dtype, device=context.device)
    additive.masked_fill_(~allowed, torch.finfo(dtype).min)
    return ids.unsqueeze(0), positions.unsqueeze(0), additive.view(1, 1, total, total)


class ReferenceDecoder:
    """SpecDiff-2 decoding with any HF causal LM as verifier and any drafter callable.

    gamma / num_drafts: draft window and number of drafts K; drafter_temperature / drafter_top_k:
    the drafter's sampling (T_d); rule: "point-mass" (paper, self-selection by tau), "tree"
    (multi-candidate) or "standard" (min(1, p/q); K = 1 only); temperature / top_k / top_p: the
    request's own sampling settings, which define the target distribution.
    """

    def __init__(self, verifier: torch.nn.Module, drafter: DrafterFn, *, gamma: int,
                 num_drafts: int = 1, drafter_temperature: float = 1.0,
                 drafter_top_k: int | None = None, rule: Rule = "point-mass",
                 temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None) -> None:
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        if num_drafts < 1:
            raise ValueError(f"num_drafts must be >= 1, got {num_drafts}")
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        if rule == "standard" and num_drafts != 1:
            raise ValueError("the standard min(1, p/q) rule is only lossless for num_drafts=1")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.verifier = verifier.eval()
        self.drafter = drafter
        self.gamma = gamma
        self.num_drafts = num_drafts
        self.drafter_temperature = drafter_temperature
        self.drafter_top_k = drafter_top_k
        self.rule = rule
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.vocab_size = _verifier_vocab(verifier)

    @torch.no_grad()
    def tree_logits(self, context: torch.Tensor, tree: TokenTree) -> torch.Tensor:
        """Verifier logits [N, V] at every tree node (root = last context token)."""
        dtype = next(self.verifier.parameters()).dtype
        ids, positions, mask = tree_attention_inputs(context, tree, dtype)
        out = self.verifier(input_ids=ids, position_ids=positions, attention_mask=mask)
        return out.logits[0, context.shape[0] - 1:].float()

    def _draft(self, context: torch.Tensor, generator: torch.Generator | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.drafter(context, self.gamma)
        if logits.shape != (self.gamma, self.vocab_size):
            raise ValueError(f"drafter returned logits of shape {tuple(logits.shape)}, expected "
                             f"({self.gamma}, {self.vocab_size}) over the verifier's vocabulary")
        marginals = draft_marginals(logits.float().unsqueeze(0), self.drafter_temperature,
                                    self.drafter_top_k)
        return marginals, sample_drafts(marginals, self.num_drafts, generator)

    @torch.no_grad()
    def step(self, context: torch.Tensor, generator: torch.Generator | None = None
             ) -> tuple[Verdict, torch.Tensor | None]:
        """One draft-and-verify step; returns the verdict and the selected draft (None for tree)."""
        marginals, drafts = self._draft(context, generator)
        tree = build_token_tree(context[-1:], drafts)
        node_logits = self.tree_logits(context, tree)
        if self.rule == "tree":
            node_probs = target_probs(node_logits, self.temperature, self.top_k, self.top_p)
            return verify_tree(node_probs, tree, generator), None
        scores = score_drafts(node_logits, tree, self.temperature, self.top_k, self.top_p)
        selected = scores.selected
        chosen = drafts[torch.arange(1), selected]
        if self.temperature == 0:
            path_argmax = path_probs(node_logits, tree, selected).argmax(dim=-1)
            return verify_greedy(path_argmax, chosen), selected
        node_probs = target_probs(node_logits, self.temperature, self.top_k, self.top_p)
        target = path_probs(node_probs, tree, selected)
        if self.rule == "standard":
            return verify_standard(target, chosen, marginals, generator), selected
        return verify_point_mass(target, chosen, generator), selected

    def generate(self, prompt_ids: torch.Tensor | list[int], max_new_tokens: int,
                 eos_token_id: int | None = None, generator: torch.Generator | None = None
                 ) -> GenerationResult:
        """Generate up to max_new_tokens after the prompt (stopping after eos_token_id)."""
        device = next(self.verifier.parameters()).device
        context = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(-1)
        if context.numel() == 0:
            raise ValueError("the prompt must contain at least one token")
        result = GenerationResult(tokens=[])
        while len(result.tokens) < max_new_tokens:
            verdict, selected = self.step(context, generator)
            result.stats.record(verdict.num_accepted, self.gamma, selected, self.num_drafts)
            new = verdict.token_lists()[0]
            for token in new:
                result.tokens.append(token)
                if token == eos_token_id or len(result.tokens) >= max_new_tokens:
                    return result
            context = torch.cat([context, torch.tensor(new, device=device)])
        return result


@torch.no_grad()
def plain_generate(verifier: torch.nn.Module, prompt_ids: torch.Tensor | list[int],
                   max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
                   top_p: float | None = None, eos_token_id: int | None = None,
                   generator: torch.Generator | None = None) -> list[int]:
    """Plain autoregressive decoding with the same target distribution: the baseline."""
    device = next(verifier.parameters()).device
    context = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(1, -1)
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        logits = verifier(input_ids=context).logits[0, -1:].float()
        probs = target_probs(logits, temperature, top_k, top_p)
        token = int(torch.multinomial(probs, 1, generator=generator)) if temperature > 0 else \
            int(probs.argmax())
        tokens.append(token)
        if token == eos_token_id:
            break
        context = torch.cat([context, torch.tensor([[token]], device=device)], dim=1)
    return tokens


@torch.no_grad()
def exact_first_three(verifier: torch.nn.Module, prompt_ids: list[int]) -> torch.Tensor:
    """p(x1, x2, x3 | prompt) at temperature 1 for all V**3 continuations (float64 [V**3],
    index (x1 * V + x2) * V + x3), from one batched forward: what sampled output is tested
    against. Only for tiny vocabularies (V**2 sequences)."""
    v = _verifier_vocab(verifier)
    device = next(verifier.parameters()).device
    seqs = torch.tensor([prompt_ids + list(c) for c in itertools.product(range(v), repeat=2)],
                        device=device)
    logp = verifier(input_ids=seqs).logits.double().log_softmax(-1).cpu()
    p = len(prompt_ids)
    first = logp[0, p - 1]                 # [V]
    second = logp[::v, p].view(v, v)       # rows x1 (x2 irrelevant for this slice)
    third = logp[:, p + 1].view(v, v, v)   # [x1, x2, x3]
    return (first.view(v, 1, 1) + second.view(v, v, 1) + third).exp().reshape(-1)


def first_three_counts(decoder: ReferenceDecoder, prompt_ids: list[int], trials: int,
                       generator: torch.Generator | None = None) -> tuple[torch.Tensor, int]:
    """How often each first three tokens came out in `trials` generations (float64 [V**3],
    indexed as `exact_first_three`), and the draft tokens accepted in all of them."""
    v = decoder.vocab_size
    counts = torch.zeros(v ** 3, dtype=torch.float64)
    accepted = 0
    for _ in range(trials):
        result = decoder.generate(prompt_ids, 3, generator=generator)
        a, b, c = result.tokens
        counts[(a * v + b) * v + c] += 1
        accepted += result.stats.accepted_tokens
    return counts, accepted


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness-of-fit p-value of `counts` against `probs`, the cells expected below 5
    pooled into one (scipy's chisquare on the pooled cells, without scipy); `probs` is
    renormalised (a float32 joint sums to 1 only within ~1e-6)."""
    expected = probs.double() / probs.double().sum() * counts.sum()
    keep = expected >= 5
    obs, exp = counts.double()[keep], expected[keep]
    if not keep.all():
        obs = torch.cat([obs, counts.double()[~keep].sum().view(1)])
        exp = torch.cat([exp, expected[~keep].sum().view(1)])
    if obs.numel() < 2:
        raise ValueError(f"too few counts ({int(counts.sum())}) for a chi-square test: no cell "
                         "is expected 5 times or more")
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor((obs.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))
