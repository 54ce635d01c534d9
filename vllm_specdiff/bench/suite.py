"""Run the suite: every method on the same verifier and prompts, in one process.

A cell is (prompt set, temperature, batch size). In each repeat of a cell every method decodes
all its prompts, batched one of two ways (`BATCHING`):

- "static": B prompts at a time, all added at once (as one `llm.generate` call); each batch is
  decoded by every method, the order rotated per batch and repeat. A batch lasts as long as
  its slowest request: tokens a draft gains for the other rows save only what their share of
  the later, smaller steps costs.
- "continuous": the whole set in one pass with B requests in flight, a finished request's slot
  going to the next prompt at once (a server under B concurrent clients, or an offline job
  with max_num_seqs B); the method order is rotated per repeat.

The methods share a pass one of two ways (`INTERLEAVE`): "pass", each decodes it in turn; or
"step", one engine step of each in turn. Each engine is timed on its own clock, which runs only
during its steps, so with "step" a change in the machine's speed (other processes on a shared
host) hits every method alike within a fraction of a second instead of between passes of
several seconds. The SpecDiff proposer's cost model reads the same clock, so it prices its own
engine's steps only.

Throughput follows ALGORITHM.md section 5: (new tokens - 1) / time, per request (static: the
batch's time, as one generate call; continuous: its own latency) and aggregate (all tokens over
all time); every timing figure is the median over repeats, counters are summed over them. At
temperature 0 each method's outputs must equal plain decoding's.
"""
from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from vllm_specdiff.bench.counters import (
    ProposerCounts,
    SpecCounters,
    accumulate,
    delta,
)
from vllm_specdiff.bench.methods import Method

BATCHING = ("static", "continuous")
INTERLEAVE = ("pass", "step")
_request_ids = itertools.count()  # bench request ids, unique within the process


@dataclass
class Run:
    """One method's pass over a cell's prompts (one repeat)."""

    seconds: float = 0.0
    new_tokens: list[int] = field(default_factory=list)
    per_request_tps: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    counters: dict[str, Any] = field(default_factory=dict)
    proposer: ProposerCounts = field(default_factory=ProposerCounts)

    @property
    def tokens_per_s(self) -> float:
        counted = sum(max(n - 1, 0) for n in self.new_tokens)
        return counted / self.seconds if self.seconds else 0.0

    @property
    def per_request_tokens_per_s(self) -> float:
        return statistics.fmean(self.per_request_tps) if self.per_request_tps else 0.0


def sampling_params(temperature: float, max_tokens: int, seed: int, count: int) -> list[Any]:
    """One SamplingParams per prompt; at temperature > 0 prompt i has seed `seed + i` in every
    method, so the methods sample alike."""
    from vllm import SamplingParams

    return [SamplingParams(temperature=temperature, max_tokens=max_tokens,
                           seed=seed + i if temperature > 0 else None) for i in range(count)]


class EngineClock:
    """Seconds one engine has spent in its own steps (and adding its requests): it runs only
    while that engine works, so passes stepped side by side (`INTERLEAVE` "step") each count
    their own time. `timer` is the wall clock it reads."""

    def __init__(self, timer: Callable[[], float] = time.perf_counter) -> None:
        self.timer = timer
        self.seconds = 0.0
        self._began: float | None = None

    def now(self) -> float:
        """The engine's time so far, the current step's part included."""
        running = 0.0 if self._began is None else self.timer() - self._began
        return self.seconds + running

    def run(self, work: Callable[[], Any]) -> Any:
        """Do `work` (one engine call) on this clock."""
        self._began = self.timer()
        try:
            return work()
        finally:
            self.seconds += self.timer() - self._began
            self._began = None


def in_process_proposer(llm: Any) -> Any:
    """The engine's proposer object when its worker runs in this process, else None."""
    executor = getattr(llm.llm_engine, "model_executor", None)
    worker = getattr(getattr(executor, "driver_worker", None), "worker", None)
    return getattr(getattr(worker, "model_runner", None), "drafter", None)


@dataclass
class Engine:
    """One method's `vllm.LLM`, its spec-decode counts and its own clock, which the SpecDiff
    proposer's cost model reads too (so it times its own engine's steps only)."""

    llm: Any
    counters: SpecCounters
    clock: EngineClock = field(default_factory=EngineClock)

    @classmethod
    def of(cls, llm: Any) -> Engine:
        engine = cls(llm, SpecCounters(llm))
        proposer = in_process_proposer(llm)
        if hasattr(proposer, "clock"):
            proposer.clock = engine.clock.now
        return engine

    def snapshot(self) -> tuple[dict[str, Any], ProposerCounts]:
        """vLLM's spec-decode counts and the SpecDiff proposer's own."""
        from vllm_specdiff.plugin.engine import specdiff_stats

        proposer = specdiff_stats(self.llm).get("proposer") or {}
        return self.counters.snapshot(), ProposerCounts.of(proposer)


class Lane:
    """One method's pass over some prompts, one engine step at a time, timed on the engine's
    clock: at most `concurrency` requests in flight, each finished request's slot going to the
    next prompt before the next step (static batching: concurrency = all the prompts).

    `finish` adds to `run` the pass's engine time, the tokens (in prompt order), each
    request's throughput (static: over the whole pass, as one generate call; continuous: over
    its own latency) and the engine's counter deltas.
    """

    def __init__(self, engine: Engine, prompts: list[list[int]], params: list[Any],
                 concurrency: int, static: bool) -> None:
        self.engine, self.static, self.concurrency = engine, static, concurrency
        self.core = engine.llm.llm_engine
        self.waiting = list(enumerate(zip(prompts, params, strict=True)))[::-1]
        self.in_flight: dict[str, tuple[int, float]] = {}  # request id -> (prompt, start)
        self.done: dict[int, tuple[list[int], float]] = {}
        self.before = engine.snapshot()
        self.began = engine.clock.now()
        engine.clock.run(self._fill)

    @property
    def finished(self) -> bool:
        return not self.in_flight and not self.waiting

    def _fill(self) -> None:
        from vllm.inputs import TokensPrompt

        while self.waiting and len(self.in_flight) < self.concurrency:
            index, (ids, param) = self.waiting.pop()
            request_id = f"bench-{next(_request_ids)}"
            self.core.add_request(request_id, TokensPrompt(prompt_token_ids=ids), param)
            self.in_flight[request_id] = (index, self.engine.clock.now())

    def step(self) -> None:
        """One engine step; the requests it finished leave, the next prompts take their
        slots."""
        self.engine.clock.run(self._step)

    def _step(self) -> None:
        if not self.core.has_unfinished_requests():
            raise RuntimeError(f"the engine has no unfinished request but the bench waits "
                               f"for {len(self.in_flight)}")
        for out in self.core.step():
            if out.finished and out.request_id in self.in_flight:
                index, start = self.in_flight.pop(out.request_id)
                self.done[index] = (list(out.outputs[0].token_ids),
                                    self.engine.clock.now() - start)
        self._fill()

    def finish(self, run: Run) -> None:
        seconds = self.engine.clock.now() - self.began
        results = [self.done[i] for i in range(len(self.done))]
        if self.static:
            results = [(tokens, seconds) for tokens, _ in results]
        _record(run, self.engine, self.before, seconds, results)


def run_lanes(lanes: list[Lane], interleave: str) -> None:
    """Run every lane to its end: one after another ("pass"), or one step of each in turn
    ("step": a change in the machine's speed then hits every method alike)."""
    if interleave not in INTERLEAVE:
        raise ValueError(f"interleave must be one of {INTERLEAVE}, got {interleave!r}")
    if interleave == "pass":
        for lane in lanes:
            while not lane.finished:
                lane.step()
        return
    while not all(lane.finished for lane in lanes):
        for lane in lanes:
            if not lane.finished:
                lane.step()


def _record(run: Run, engine: Engine, before: tuple[dict[str, Any], ProposerCounts],
            seconds: float, results: list[tuple[list[int], float]]) -> None:
    """Add one pass to `run`: its wall time, each request's (tokens, seconds it took) in prompt
    order, and the engine's counter deltas since `before` (its snapshot at the start)."""
    counters, proposer = before
    after, proposer_after = engine.snapshot()
    run.seconds += seconds
    for tokens, latency in results:
        run.outputs.append(tokens)
        run.new_tokens.append(len(tokens))
        run.per_request_tps.append(max(len(tokens) - 1, 0) / latency if latency else 0.0)
    accumulate(run.counters, delta(after, counters))
    run.proposer = run.proposer.plus(proposer_after.plus(proposer, -1))


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def _sum_counters(runs: list[Run]) -> dict[str, Any]:
    total: dict[str, Any] = {}
    for run in runs:
        accumulate(total, run.counters)
    return total


def mismatches(outputs: list[list[int]], reference: list[list[int]]) -> list[int]:
    """Indices of the prompts whose output differs from the reference (plain decoding)."""
    return [i for i, (a, b) in enumerate(zip(outputs, reference, strict=True)) if a != b]


def summarize(method: Method, runs: list[Run], plain_runs: list[Run],
              temperature: float) -> dict[str, Any]:
    """The per-cell figures of one method (see the module docstring)."""
    counters = _sum_counters(runs)
    drafts = counters.get("num_drafts", 0)
    per_pos = counters.get("num_accepted_tokens_per_pos")
    drafted_pos = counters.get("num_draft_tokens_per_pos")
    proposer = ProposerCounts()
    for run in runs:
        proposer = proposer.plus(run.proposer)
    calls = proposer.propose_calls
    seconds = sum(r.seconds for r in runs)
    drafter_ms = 1000.0 * proposer.drafter_seconds / calls if calls else None
    step_ms = 1000.0 * seconds / calls if calls else None
    bad = sorted({i for run, ref in zip(runs, plain_runs, strict=True)
                  for i in mismatches(run.outputs, ref.outputs)}) if temperature == 0 else []
    return {
        "method": method.label,
        "tokens_per_s": _median([r.tokens_per_s for r in runs]),
        "per_request_tokens_per_s": _median([r.per_request_tokens_per_s for r in runs]),
        "speedup": _median([r.tokens_per_s / p.tokens_per_s
                            for r, p in zip(runs, plain_runs, strict=True) if p.tokens_per_s]),
        "per_request_speedup": _median(
            [r.per_request_tokens_per_s / p.per_request_tokens_per_s
             for r, p in zip(runs, plain_runs, strict=True) if p.per_request_tokens_per_s]),
        "repeat_tokens_per_s": [round(r.tokens_per_s, 3) for r in runs],
        "new_tokens": sum(sum(r.new_tokens) for r in runs),
        "drafts": drafts or None,
        "accepted_per_step": counters.get("num_accepted_tokens", 0) / drafts if drafts else None,
        "per_position_acceptance": [round(a / drafts, 4) for a in per_pos]
        if drafts and per_pos else None,
        "per_position_acceptance_of_drafted": [round(a / d, 4) if d else None
                                               for a, d in zip(per_pos, drafted_pos,
                                                               strict=True)]
        if drafts and per_pos and drafted_pos else None,
        "spec_decode_counts": counters or None,
        "drafter_ms_per_step": round(drafter_ms, 3) if drafter_ms is not None else None,
        "step_ms": round(step_ms, 3) if step_ms is not None else None,
        "drafter_share_of_step": round(drafter_ms / step_ms, 4)
        if drafter_ms is not None and step_ms else None,
        "chosen_gamma_histogram": proposer.gamma_histogram or None,
        "lookup_gamma_histogram": proposer.lookup_gamma_histogram or None,
        "lookup_share_of_drafts": round(proposer.lookup_drafts / proposer.drafted_rows, 4)
        if proposer.drafted_rows else None,
        "draft_shape_steps": dict(sorted(proposer.shape_steps.items())) or None,
        "idle_steps": proposer.idle_steps if calls else None,
        "drafter_ms_per_idle_step": round(1000.0 * proposer.idle_seconds / proposer.idle_steps, 3)
        if proposer.idle_steps else None,
        "identical_to_plain": (not bad) if temperature == 0 else None,
        "mismatched_prompts": bad,
    }


def passes(num_prompts: int, batch_size: int, batching: str) -> list[range]:
    """The prompt ranges one method decodes in turn per repeat: B-prompt batches (static) or
    the whole set (continuous)."""
    if batching not in BATCHING:
        raise ValueError(f"batching must be one of {BATCHING}, got {batching!r}")
    if batching == "continuous":
        return [range(num_prompts)]
    return [range(s, min(s + batch_size, num_prompts)) for s in range(0, num_prompts, batch_size)]


def run_cell(engines: dict[str, Engine], methods: list[Method], prompts: list[list[int]],
             temperature: float, batch_size: int, max_tokens: int, repeats: int, seed: int,
             bar: tqdm, batching: str = "static", interleave: str = "pass"
             ) -> list[dict[str, Any]]:
    """All methods on one (prompt set, temperature, batch size): each pass over the prompts
    (`passes`) is decoded by every method, the order rotated per pass and repeat, one method
    after another or step by step side by side (`interleave`)."""
    params = sampling_params(temperature, max_tokens, seed, len(prompts))
    runs: dict[str, list[Run]] = {m.label: [] for m in methods}
    for r in range(repeats):
        current = {m.label: Run() for m in methods}
        for j, part in enumerate(passes(len(prompts), batch_size, batching)):
            shift = (r + j) % len(methods)
            order = methods[shift:] + methods[:shift]
            chunk, chunk_params = [prompts[i] for i in part], [params[i] for i in part]
            static = batching == "static"
            concurrency = len(chunk) if static else batch_size
            bar.set_postfix_str(" / ".join(m.label for m in order))
            lanes = [Lane(engines[m.label], chunk, chunk_params, concurrency, static)
                     for m in order]
            run_lanes(lanes, interleave)
            for method, lane in zip(order, lanes, strict=True):
                lane.finish(current[method.label])
            bar.update(len(order))
        for label, run in current.items():
            runs[label].append(run)
    plain = runs[methods[0].label]
    return [summarize(m, runs[m.label], plain, temperature) for m in methods]


def run_suite(engines: dict[str, Engine], methods: list[Method],
              prompt_sets: dict[str, list[list[int]]], temperatures: list[float],
              batch_sizes: list[int], max_tokens: int, repeats: int, seed: int,
              progress: bool = True, batching: str = "static", interleave: str = "pass"
              ) -> list[dict[str, Any]]:
    """Every cell of the suite; methods[0] is plain decoding (the reference)."""
    total = sum(len(passes(len(prompts), batch, batching)) for prompts in prompt_sets.values()
                for batch in batch_sizes) * len(temperatures) * repeats * len(methods)
    cells: list[dict[str, Any]] = []
    with tqdm(total=total, desc="bench", unit="pass", disable=not progress) as bar:
        for name, prompts in prompt_sets.items():
            for temperature in temperatures:
                for batch in batch_sizes:
                    bar.set_description(f"{name} T={temperature:g} B={batch}")
                    results = run_cell(engines, methods, prompts, temperature, batch,
                                       max_tokens, repeats, seed, bar, batching, interleave)
                    cells.extend({"prompts": name, "num_prompts": len(prompts),
                                  "temperature": temperature, "batch_size": batch,
                                  "batching": batching, "interleave": interleave, **res}
                                 for res in results)
    return cells


def identity_failures(cells: list[dict[str, Any]]) -> list[str]:
    """One line per greedy cell whose outputs differ from plain decoding (exit status 1)."""
    return [f"{c['method']} on {c['prompts']} at batch {c['batch_size']}: prompts "
            f"{c['mismatched_prompts']} differ from plain decoding"
            for c in cells if c["temperature"] == 0 and c["identical_to_plain"] is False]


def warm_up(engines: dict[str, Engine], prompts: list[list[int]], batch: int) -> None:
    """One short batch per engine, so the first measured run pays no start-up cost (on the
    engine's clock, like every step the proposer times)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4)
    chunk = prompts[:batch]
    for engine in engines.values():
        run_lanes([Lane(engine, chunk, [params] * len(chunk), len(chunk), static=True)], "pass")
