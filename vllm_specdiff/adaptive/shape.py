"""Chain or best-first tree: which draft shape pays, from committed tokens per second measured
while serving.

A best-first tree of g nodes accepts more than a chain of g tokens (docs/vllm.md, "Best-first
trees"), but verifying it can cost more than verifying the chain: on a CPU the trie rows are
recomputed outside vLLM's attention kernel (+30-40% per step at batch 1, measured), on a GPU
the tree kernel adds little. Which shape is faster is therefore a property of the host, the
drafter and the requests, measured here rather than assumed: each shape's committed tokens and
step seconds are smoothed separately, the better one drafts, and the other is tried for a few
steps every `explore_every` steps so that a changed host or workload is noticed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SHAPES = ("chain", "tree")


@dataclass
class ShapeRate:
    """Forgetting sums of one shape's committed tokens and step seconds."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: float, seconds: float, forget: float) -> None:
        self.tokens = forget * self.tokens + tokens
        self.seconds = forget * self.seconds + seconds
        self.steps += 1

    @property
    def rate(self) -> float | None:
        """Committed tokens per second; None until measured."""
        return self.tokens / self.seconds if self.steps and self.seconds > 0 else None


@dataclass
class ShapeChoice:
    """Which shape the next step drafts. `observe` takes each finished step's shape, committed
    tokens (all rows) and seconds (verifier step plus drafting); `choose` answers "chain" or
    "tree": each is tried for `trial_steps` first, then the faster one, the other again for
    `trial_steps` every `explore_every` steps."""

    explore_every: int = 64
    trial_steps: int = 4
    forget: float = 0.98  # memory of ~50 steps per shape
    rates: dict[str, ShapeRate] = field(default_factory=lambda: {s: ShapeRate() for s in SHAPES})
    steps: int = 0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SHAPES, 0))

    def observe(self, shape: str, tokens: float, seconds: float) -> None:
        if shape not in self.rates:
            raise ValueError(f"unknown draft shape {shape!r}; one of {SHAPES}")
        if seconds > 0:
            self.rates[shape].add(tokens, seconds, self.forget)

    def best(self) -> str:
        """The faster shape measured so far (the tree until both are measured)."""
        chain, tree = self.rates["chain"].rate, self.rates["tree"].rate
        if chain is None or tree is None:
            return "tree"
        return "tree" if tree >= chain else "chain"

    def choose(self) -> str:
        self.steps += 1
        for shape in SHAPES:  # a shape not yet measured enough is tried first
            if self.rates[shape].steps < self.trial_steps:
                return self._count(shape)
        best = self.best()
        other = SHAPES[1 - SHAPES.index(best)]
        if self.steps % self.explore_every < self.trial_steps:
            return self._count(other)
        return self._count(best)

    def _count(self, shape: str) -> str:
        self.counts[shape] += 1
        return shape

    def stats(self) -> dict[str, object]:
        return {"steps": dict(self.counts), "best": self.best(),
                "tokens_per_s": {s: r.rate for s, r in self.rates.items()}}
