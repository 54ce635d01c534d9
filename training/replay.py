"""Greedy serving replayed on data: the accepted length per step that serving reports.

`eval`'s windows weight every position of a continuation alike, but serving drafts only where
the previous step stopped: after a long accepted streak it skips the easy stretch, so it lands
on hard positions more often than uniform anchors do. On the verifier's greedy continuations of
40 HumanEval-as-chat prompts the shipped conditioned drafter accepted 1.22 tokens over uniform
anchors, 0.93 replayed in serving order, and 0.89 served through vLLM. Replaying each sequence
step by step (K = 1, fixed gamma, T = 0: the draft is the drafter's argmax, accepted while it
matches the verifier's greedy token) predicts the served figure without a server.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_specdiff.core.best_first import best_first_tree, greedy_tree_accepted

from .data import SequenceData
from .windows import make_batch, valid_starts


def input_lookahead(drafter: Any, gamma: int) -> int:
    """Tokens past the last window start a drafter's `window_logits` reads: a Markov head's
    slots read their targets' prefixes (teacher forced: under greedy acceptance, the drafter's
    own path wherever it counts); a drafter without the method reads the context only."""
    lookahead = getattr(drafter, "input_lookahead", None)
    return 0 if lookahead is None else lookahead(gamma)


def window_logits(drafter: Any, data: SequenceData, i: int, gamma: int
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The drafter's verifier-vocabulary logits [S, gamma, V] and the verifier's tokens
    [S, gamma] at every start of sequence i that serving can draft from (the first generated
    token comes from prefill, so from prompt length + 1 on); None when there is none."""
    starts = list(valid_starts(data, i, gamma, min_context=int(data.prompt_lens[i]) + 1))
    if not starts:
        return None
    batch = make_batch(data, [i], [starts], gamma, lookahead=input_lookahead(drafter, gamma))
    extra = () if batch.features is None else (batch.features,)
    with torch.inference_mode():
        raw = drafter.window_logits(batch.input_ids, batch.starts, gamma, *extra)
    return drafter.to_verifier_vocab(raw[0]), batch.tokens[0]


def chain_streaks(logits: torch.Tensor, tokens: torch.Tensor, length: int) -> list[int]:
    """Greedy accepted length of the argmax chain cut to `length` tokens, per window."""
    hits = logits[:, :length].argmax(-1) == tokens[:, :length]
    return hits.int().cumprod(-1).sum(-1).tolist()


def tree_streaks(logits: torch.Tensor, tokens: torch.Tensor, budget: int) -> list[int]:
    """Greedy accepted length of the best-first tree of `budget` nodes per window
    (`core.best_first`: one forward's marginals, DDTree's construction)."""
    logprobs = logits.float().log_softmax(-1)
    return [greedy_tree_accepted(best_first_tree(lp, budget), t)
            for lp, t in zip(logprobs, tokens, strict=True)]


def accepted_streaks(drafter: Any, data: SequenceData, i: int, gamma: int) -> list[int]:
    """Greedy accepted length of the argmax chain at every start of sequence i."""
    windows = window_logits(drafter, data, i, gamma)
    return [] if windows is None else chain_streaks(*windows, gamma)


def serving_order(streaks: list[int]) -> list[int]:
    """The accepted lengths of the steps serving takes: each step drafts right after the tokens
    the last one committed (its accepted drafts and the verifier's own next token)."""
    steps, k = [], 0
    while k < len(streaks):
        steps.append(streaks[k])
        k += streaks[k] + 1
    return steps


def replay_greedy(drafter: Any, data: SequenceData, gamma: int,
                  tree_budgets: tuple[int, ...] = ()) -> dict[str, Any]:
    """Serving-order greedy accepted length per step over every sequence of `data`; with
    `tree_budgets`, also that of best-first trees of those node budgets (and of the argmax
    chain cut to the same number of verified tokens, where the budget is below gamma)."""
    variants: dict[str, Any] = {"replay": lambda lg, tk: chain_streaks(lg, tk, gamma)}
    for budget in tree_budgets:
        variants[f"replay_tree{budget}"] = lambda lg, tk, b=budget: tree_streaks(lg, tk, b)
        if budget < gamma:
            variants[f"replay_chain{budget}"] = lambda lg, tk, b=budget: chain_streaks(lg, tk, b)
    steps: dict[str, list[int]] = {name: [] for name in variants}
    for i in range(len(data)):
        windows = window_logits(drafter, data, i, gamma)
        if windows is None:
            continue
        for name, streaks in variants.items():
            steps[name] += serving_order(streaks(*windows))
    chain = steps["replay"]
    if not chain:
        raise ValueError(f"no sequence is longer than its prompt + {gamma + 1} tokens: nothing "
                         "to replay")
    out: dict[str, Any] = {
        "replay_accepted_per_step": sum(chain) / len(chain), "replay_steps": len(chain),
        "replay_histogram": [chain.count(a) for a in range(gamma + 1)]}
    for name, taken in steps.items():
        if name != "replay":
            out[f"{name}_accepted_per_step"] = sum(taken) / len(taken)
    return out
