"""Run the suite: every method on the same verifier and prompts, in one process.

A cell is (prompt set, temperature, batch size). In each repeat of a cell every method decodes
all its prompts, batched one of two ways (`BATCHING`):

- "static": B prompts at a time in one `llm.generate` call; each batch is decoded by every
  method in turn, the order rotated per batch and repeat, so noise from other processes hits
  every method alike. A batch lasts as long as its slowest request: tokens a draft gains for
  the other rows save only what their share of the later, smaller steps costs.
- "continuous": the whole set in one pass with B requests in flight, a finished request's slot
  going to the next prompt at once (a server under B concurrent clients, or an offline job
  with max_num_seqs B); the method order is rotated per repeat.

Throughput follows ALGORITHM.md section 5: (new tokens - 1) / wall time, per request (static:
its generate call's wall time; continuous: its own latency) and aggregate (all tokens over all
wall time); every timing figure is the median over repeats, counters are summed over them. At
temperature 0 each method's outputs must equal plain decoding's.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from vllm_specdiff.bench.methods import Method

BATCHING = ("static", "continuous")
_request_ids = itertools.count()  # bench request ids, unique within the process


def _add_lists(a: list[int], b: list[int], sign: int = 1) -> list[int]:
    """a + sign * b element-wise; an empty list counts as zeros."""
    if not a or not b:
        return list(a) if a else [sign * v for v in b]
    return [x + sign * y for x, y in zip(a, b, strict=True)]


@dataclass
class ProposerCounts:
    """The SpecDiff proposer's own counters (all zero for other methods): drafter time and
    calls, rows drafted (by the drafter or by prompt lookup) and by lookup, and adaptive
    drafting's histograms of chosen drafter and lookup lengths ([] when it is off)."""

    drafter_seconds: float = 0.0
    propose_calls: int = 0
    drafted_rows: int = 0
    lookup_drafts: int = 0
    gamma_histogram: list[int] = field(default_factory=list)
    lookup_gamma_histogram: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, proposer: dict[str, Any]) -> ProposerCounts:
        adaptive = proposer.get("adaptive") or {}
        return cls(float(proposer.get("drafter_seconds", 0.0)),
                   int(proposer.get("propose_calls", 0)), int(proposer.get("drafted_rows", 0)),
                   int(proposer.get("lookup_drafts", 0)),
                   list(adaptive.get("chosen_gamma_histogram") or []),
                   list(adaptive.get("lookup_gamma_histogram") or []))

    def plus(self, other: ProposerCounts, sign: int = 1) -> ProposerCounts:
        return ProposerCounts(
            self.drafter_seconds + sign * other.drafter_seconds,
            self.propose_calls + sign * other.propose_calls,
            self.drafted_rows + sign * other.drafted_rows,
            self.lookup_drafts + sign * other.lookup_drafts,
            _add_lists(self.gamma_histogram, other.gamma_histogram, sign),
            _add_lists(self.lookup_gamma_histogram, other.lookup_gamma_histogram, sign))


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


COUNTS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PER_POS = ("num_accepted_tokens_per_pos", "num_draft_tokens_per_pos")


class SpecCounters:
    """vLLM's spec-decode counts (drafts, draft and accepted tokens, accepted per position) of
    one engine, summed from the scheduler stats its logger manager receives every step.

    `LLM.get_metrics()` cannot be used with several engines: vLLM's Prometheus collectors are
    process-global and each new engine unregisters the previous ones, so only the engine built
    last would be counted.
    """

    def __init__(self, llm: Any) -> None:  # noqa: ANN401
        self.totals: dict[str, Any] = {**dict.fromkeys(COUNTS, 0),
                                       **{key: [] for key in PER_POS}}
        manager = llm.llm_engine.logger_manager
        if manager is None:
            raise ValueError("the bench needs vLLM's stats (engine built with "
                             "disable_log_stats=False)")
        record = manager.record

        def counted(scheduler_stats: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
            spec = getattr(scheduler_stats, "spec_decoding_stats", None)
            if spec is not None:
                self.observe(spec)
            return record(scheduler_stats, *args, **kwargs)

        manager.record = counted

    def observe(self, spec: Any) -> None:  # noqa: ANN401
        for key in COUNTS:
            self.totals[key] += getattr(spec, key)
        for key in PER_POS:
            per_pos = list(getattr(spec, key, None) or [])
            prev = self.totals[key] or [0] * len(per_pos)
            if per_pos:
                self.totals[key] = [a + b for a, b in zip(prev, per_pos, strict=True)]

    def snapshot(self) -> dict[str, Any]:
        return {**self.totals, **{key: list(self.totals[key]) for key in PER_POS}}


@dataclass
class Engine:
    """One method's `vllm.LLM` and its spec-decode counts."""

    llm: Any
    counters: SpecCounters

    @classmethod
    def of(cls, llm: Any) -> Engine:  # noqa: ANN401
        return cls(llm, SpecCounters(llm))

    def snapshot(self) -> tuple[dict[str, Any], ProposerCounts]:
        """vLLM's spec-decode counts and the SpecDiff proposer's own."""
        from vllm_specdiff.plugin.engine import specdiff_stats

        proposer = specdiff_stats(self.llm).get("proposer") or {}
        return self.counters.snapshot(), ProposerCounts.of(proposer)


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in (*COUNTS, *PER_POS):
        value, prev = after[key], before.get(key)
        if isinstance(value, list):
            prev = prev or [0] * len(value)
            out[key] = [a - b for a, b in zip(value, prev, strict=True)]
        else:
            out[key] = value - (prev or 0)
    return out


def run_batch(engine: Engine, prompts: list[list[int]], params: list[Any], run: Run) -> None:
    """Decode one batch in one generate call; add its wall time, tokens, outputs and counter
    deltas to `run` (each request's throughput over the call's wall time)."""
    from vllm.inputs import TokensPrompt

    before = engine.snapshot()
    began = time.perf_counter()
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params,
                               use_tqdm=False)
    seconds = time.perf_counter() - began
    _record(run, engine, before, seconds,
            [(list(out.outputs[0].token_ids), seconds) for out in outs])


def run_stream(engine: Engine, prompts: list[list[int]], params: list[Any], concurrency: int,
               run: Run) -> None:
    """Decode all prompts with `concurrency` requests in flight (continuous batching): each
    finished request's slot goes to the next prompt before the next engine step. Adds the wall
    time, tokens (in prompt order), each request's own throughput and the counter deltas to
    `run`."""
    from vllm.inputs import TokensPrompt

    core = engine.llm.llm_engine
    before = engine.snapshot()
    in_flight: dict[str, tuple[int, float]] = {}  # request id -> (prompt index, start)
    done: dict[int, tuple[list[int], float]] = {}
    began = time.perf_counter()
    for i, (ids, param) in enumerate(zip(prompts, params, strict=True)):
        while len(in_flight) >= concurrency:
            _step(core, in_flight, done)
        request_id = f"bench-{next(_request_ids)}"
        core.add_request(request_id, TokensPrompt(prompt_token_ids=ids), param)
        in_flight[request_id] = (i, time.perf_counter())
    while in_flight:
        _step(core, in_flight, done)
    _record(run, engine, before, time.perf_counter() - began,
            [done[i] for i in range(len(prompts))])


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
    _accumulate(run.counters, _delta(after, counters))
    run.proposer = run.proposer.plus(proposer_after.plus(proposer, -1))


def _step(core: Any, in_flight: dict[str, tuple[int, float]],  # noqa: ANN401
          done: dict[int, tuple[list[int], float]]) -> None:
    """One engine step; move the requests it finished from `in_flight` to `done`."""
    if not core.has_unfinished_requests():
        raise RuntimeError(f"the engine has no unfinished request but the bench waits for "
                           f"{len(in_flight)}")
    for out in core.step():
        if out.finished and out.request_id in in_flight:
            index, start = in_flight.pop(out.request_id)
            done[index] = (list(out.outputs[0].token_ids), time.perf_counter() - start)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def _accumulate(total: dict[str, Any], counts: dict[str, Any]) -> None:
    for key, value in counts.items():
        if isinstance(value, list):
            if value:
                prev = total.get(key) or [0] * len(value)
                total[key] = [a + b for a, b in zip(prev, value, strict=True)]
        else:
            total[key] = total.get(key, 0) + value


def _sum_counters(runs: list[Run]) -> dict[str, Any]:
    total: dict[str, Any] = {}
    for run in runs:
        _accumulate(total, run.counters)
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
             bar: tqdm, batching: str = "static") -> list[dict[str, Any]]:
    """All methods on one (prompt set, temperature, batch size): each pass over the prompts
    (`passes`) is decoded by every method in turn, the order rotated per pass and repeat."""
    params = sampling_params(temperature, max_tokens, seed, len(prompts))
    runs: dict[str, list[Run]] = {m.label: [] for m in methods}
    for r in range(repeats):
        current = {m.label: Run() for m in methods}
        for j, part in enumerate(passes(len(prompts), batch_size, batching)):
            shift = (r + j) % len(methods)
            chunk, chunk_params = [prompts[i] for i in part], [params[i] for i in part]
            for method in methods[shift:] + methods[:shift]:
                bar.set_postfix_str(method.label)
                if batching == "continuous":
                    run_stream(engines[method.label], chunk, chunk_params, batch_size,
                               current[method.label])
                else:
                    run_batch(engines[method.label], chunk, chunk_params, current[method.label])
                bar.update(1)
        for label, run in current.items():
            runs[label].append(run)
    plain = runs[methods[0].label]
    return [summarize(m, runs[m.label], plain, temperature) for m in methods]


def run_suite(engines: dict[str, Engine], methods: list[Method],
              prompt_sets: dict[str, list[list[int]]], temperatures: list[float],
              batch_sizes: list[int], max_tokens: int, repeats: int, seed: int,
              progress: bool = True, batching: str = "static") -> list[dict[str, Any]]:
    """Every cell of the suite; methods[0] is plain decoding (the reference)."""
    total = sum(len(passes(len(prompts), batch, batching)) for prompts in prompt_sets.values()
                for batch in batch_sizes) * len(temperatures) * repeats * len(methods)
    cells: list[dict[str, Any]] = []
    with tqdm(total=total, desc="bench", unit="batch", disable=not progress) as bar:
        for name, prompts in prompt_sets.items():
            for temperature in temperatures:
                for batch in batch_sizes:
                    bar.set_description(f"{name} T={temperature:g} B={batch}")
                    results = run_cell(engines, methods, prompts, temperature, batch,
                                       max_tokens, repeats, seed, bar, batching)
                    cells.extend({"prompts": name, "num_prompts": len(prompts),
                                  "temperature": temperature, "batch_size": batch,
                                  "batching": batching, **res}
                                 for res in results)
    return cells


def identity_failures(cells: list[dict[str, Any]]) -> list[str]:
    """One line per greedy cell whose outputs differ from plain decoding (exit status 1)."""
    return [f"{c['method']} on {c['prompts']} at batch {c['batch_size']}: prompts "
            f"{c['mismatched_prompts']} differ from plain decoding"
            for c in cells if c["temperature"] == 0 and c["identical_to_plain"] is False]


def warm_up(engines: dict[str, Engine], prompts: list[list[int]], batch: int) -> None:
    """One short batch per engine, so the first measured run pays no start-up cost."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=4)
    batch_prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompts[:batch]]
    for engine in engines.values():
        engine.llm.generate(batch_prompts, params, use_tqdm=False)
