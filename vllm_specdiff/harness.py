"""Plain vs speculative decoding of the same verifier, in one process, as a speed ratio.

Both engines live in this process and each prompt is run on both, alternating which goes first,
so load from other processes and thermal drift hit both alike; the ratio is the figure to
report, not the absolute tokens/s. Throughput follows ALGORITHM.md section 5:
(new tokens - 1) / wall time, summed over prompts; at temperature 0 the outputs must be
identical token for token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm


@dataclass
class Comparison:
    prompts: int = 0
    plain_tokens: int = 0
    spec_tokens: int = 0
    plain_seconds: float = 0.0
    spec_seconds: float = 0.0
    mismatches: list[int] = field(default_factory=list)
    spec_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def plain_tokens_per_s(self) -> float:
        return self.plain_tokens / self.plain_seconds if self.plain_seconds else 0.0

    @property
    def spec_tokens_per_s(self) -> float:
        return self.spec_tokens / self.spec_seconds if self.spec_seconds else 0.0

    @property
    def speed_ratio(self) -> float:
        plain = self.plain_tokens_per_s
        return self.spec_tokens_per_s / plain if plain else 0.0

    def step_costs(self) -> dict[str, float | None]:
        """Per engine step (ms): plain decoding, the speculative step, its drafter and verifier
        parts, and the drafter's cost relative to the verifier's (the issue's d / v)."""
        calls = self.spec_stats.get("proposer", {}).get("propose_calls", 0)
        drafter = self.spec_stats.get("drafter_ms_per_step")
        if not calls or drafter is None or not self.plain_tokens:
            return {"plain_step_ms": None, "spec_step_ms": None, "verifier_ms_per_step": None,
                    "drafter_to_verifier": None}
        spec_step = 1000.0 * self.spec_seconds / calls
        verifier = spec_step - drafter
        return {"plain_step_ms": round(1000.0 * self.plain_seconds / self.plain_tokens, 3),
                "spec_step_ms": round(spec_step, 3), "verifier_ms_per_step": round(verifier, 3),
                "drafter_to_verifier": round(drafter / verifier, 4) if verifier > 0 else None}

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompts": self.prompts,
            "plain_tokens_per_s": round(self.plain_tokens_per_s, 3),
            "spec_tokens_per_s": round(self.spec_tokens_per_s, 3),
            "speed_ratio": round(self.speed_ratio, 3),
            "identical_outputs": not self.mismatches,
            "mismatched_prompts": self.mismatches,
            "mean_accepted_length": self.spec_stats.get("mean_accepted_length"),
            "drafter_ms_per_step": self.spec_stats.get("drafter_ms_per_step"),
            **self.step_costs(),
        }


def _run(llm: Any, prompt_ids: list[int], params: Any) -> tuple[list[int], float]:
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids), time.perf_counter() - start


def compare(plain: Any, spec: Any, prompts: list[list[int]], params: Any,
            progress: bool = True) -> Comparison:
    """Decode every prompt (batch 1) with both engines; see the module docstring."""
    from vllm import SamplingParams

    from vllm_specdiff.plugin.engine import reset_specdiff_stats, specdiff_stats

    warm = SamplingParams(temperature=0.0, max_tokens=4)
    for llm in (plain, spec):
        _run(llm, prompts[0], warm)
    before = specdiff_stats(spec).get("vllm", {})
    reset_specdiff_stats(spec)
    result = Comparison()
    for i, ids in enumerate(tqdm(prompts, desc="plain vs speculative", disable=not progress)):
        order = (plain, spec) if i % 2 == 0 else (spec, plain)
        outputs = {}
        for llm in order:
            tokens, seconds = _run(llm, ids, params)
            outputs[id(llm)] = tokens
            counted = max(len(tokens) - 1, 0)
            if llm is plain:
                result.plain_tokens += counted
                result.plain_seconds += seconds
            else:
                result.spec_tokens += counted
                result.spec_seconds += seconds
        if params.temperature == 0 and outputs[id(plain)] != outputs[id(spec)]:
            result.mismatches.append(i)
        result.prompts += 1
    stats = specdiff_stats(spec)
    after = stats.get("vllm", {})
    drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
    accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
    stats["mean_accepted_length"] = accepted / drafts if drafts else 0.0
    result.spec_stats = stats
    return result
