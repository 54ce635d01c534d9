"""`vllm-specdiff bench`, the suite: `--quick` on the tiny models end to end (from outside the
checkout, as installed), the method syntax and its errors, and the greedy-identity verdict."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import word_prompt
from vllm_specdiff.bench.methods import Drafters, engine_args, parse_methods, parse_value
from vllm_specdiff.bench.suite import Run, identity_failures, summarize

GAMMA = 3
CELL_FIELDS = ("prompts", "num_prompts", "temperature", "batch_size", "method", "tokens_per_s",
               "per_request_tokens_per_s", "speedup", "per_request_speedup", "accepted_per_step",
               "per_position_acceptance", "per_position_acceptance_of_drafted",
               "spec_decode_counts", "drafter_ms_per_step", "step_ms",
               "drafter_share_of_step", "identical_to_plain", "mismatched_prompts")


@pytest.fixture
def word_prompts(tmp_path: Path) -> Path:
    path = tmp_path / "words.jsonl"
    path.write_text("".join(json.dumps({"prompt": word_prompt(i, 10)}) + "\n"
                            for i in range(3)))
    return path


@pytest.mark.vllm
def test_quick_suite_writes_json_table_and_plots(tmp_path, word_prompts, tiny_verifier,
                                                 tiny_drafter):
    out, plots = tmp_path / "out" / "suite.json", tmp_path / "plots"
    methods = "plain,ngram,specdiff2,specdiff2:gamma=2,specdiff2:adaptive=false:gamma=2,draft-model"
    cmd = [str(Path(sys.executable).with_name("vllm-specdiff")), "--no-speed-env", "bench",
           "--quick", "--prompts", str(word_prompts), "--limit", "3", "--methods", methods,
           "--batch-size", "1", "2", "--max-tokens", "8", "--gamma", str(GAMMA),
           "--model", str(tiny_verifier), "--drafter", str(tiny_drafter),
           "--draft-model", str(tiny_verifier), "--max-model-len", "256",
           "--json", str(out), "--plots", str(plots)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    cells = result["cells"]
    assert [(c["batch_size"], c["method"]) for c in cells] == \
        [(b, m) for b in (1, 2) for m in methods.split(",")]
    for cell in cells:
        assert set(CELL_FIELDS) <= set(cell), cell
        assert cell["identical_to_plain"] is True and cell["tokens_per_s"] > 0
    by = {(c["batch_size"], c["method"]): c for c in cells}
    assert by[(1, "plain")]["speedup"] == 1.0 and by[(1, "plain")]["accepted_per_step"] is None
    # Each engine's own counters: a full copy of the verifier as draft model is always right.
    assert by[(2, "draft-model")]["per_position_acceptance"] == [1.0] * GAMMA
    counts = by[(2, "draft-model")]["spec_decode_counts"]
    assert counts["num_accepted_tokens"] == counts["num_draft_tokens"] > 0
    # a fixed gamma always drafts (adaptive drafting may draft nothing with these tiny models)
    fixed = by[(1, "specdiff2:adaptive=false:gamma=2")]
    assert len(fixed["per_position_acceptance"]) == 2 and fixed["chosen_gamma_histogram"] is None
    assert by[(1, "specdiff2")]["drafter_ms_per_step"] > 0
    assert 0 < by[(1, "specdiff2")]["drafter_share_of_step"] < 1
    # adaptive drafting (the default) reports its choices per cell, over its own gamma
    assert len(by[(1, "specdiff2")]["chosen_gamma_histogram"]) == GAMMA + 1
    assert len(by[(2, "specdiff2:gamma=2")]["chosen_gamma_histogram"]) == 3
    assert sum(by[(2, "specdiff2")]["chosen_gamma_histogram"]) > 0
    assert by[(1, "ngram")]["chosen_gamma_histogram"] is None
    methods_json = {m["label"]: m for m in result["suite"]["methods"]}
    assert methods_json["ngram"]["engine_args"]["speculative_config"] == {
        "method": "ngram", "num_speculative_tokens": GAMMA, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}
    assert result["identity_failures"] == []
    assert "bench --quick" in result["provenance"]["command"]
    assert result["provenance"]["machine"]["cores"]
    table = out.with_suffix(".md").read_text()
    assert "| `specdiff2:gamma=2` |" in table and table.splitlines()[0] in proc.stdout
    names = {Path(p).name for p in result["plots"]}
    assert {"speedup_by_method.png", "acceptance_per_position.png", "gamma_sweep.png"} <= names
    for name in names:
        assert (plots / name).read_bytes()[:4] == b"\x89PNG"
    # Several engines started: none found a `triton_kernels` package that is not Triton's.
    assert "Failed to import Triton kernels" not in proc.stdout + proc.stderr


@pytest.mark.vllm
@pytest.mark.parametrize(("options", "message"), [
    (["--methods", "plain,bogus"], "unknown method 'bogus'"),
    (["--methods", "specdiff2:gamma"], "'gamma' in 'specdiff2:gamma' is not KEY=VALUE"),
    (["--methods", "ngram:K=2"], "method 'ngram' takes no option(s) ['K']"),
    (["--methods", "specdiff2:gamma=0"], "gamma must be an integer in [1,"),
    (["--methods", "specdiff2:K=0"], "'K'] must be an integer >= 1"),
    (["--methods", "ngram:prompt_lookup_min=5"], "1 <= min <= max"),
    (["--methods", "plain,draft-model"], "needs --draft-model PATH"),
    (["--methods", "plain,dflash"], "needs --dflash-model PATH"),
    (["--methods", "plain,dflash", "--dflash-model", "/nonexistent"], "needs --dflash-model PATH"),
    (["--methods", "dflash:drafter_temperature=1"], "method 'dflash' takes no option(s)"),
    (["--methods", "specdiff2,specdiff2"], "given more than once"),
    (["--methods", "ngram,ngram:gamma=4"], "one ngram method per run"),
    (["--batch-size", "1", "4", "--max-num-seqs", "2"], "below the largest --batch-size 4"),
    (["--repeats", "0"], "--repeats must be >= 1"),
])
def test_bad_options_fail_before_any_engine(options, message, word_prompts, tiny_verifier,
                                            tiny_drafter, capsys):
    from vllm_specdiff.cli import main

    rc = main(["--no-speed-env", "bench", "--prompts", str(word_prompts),
               "--model", str(tiny_verifier), "--drafter", str(tiny_drafter), *options])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err


def test_method_specs_become_engine_arguments(monkeypatch):
    from vllm_specdiff import models
    from vllm_specdiff.plugin.workers import tree_worker

    # the standalone default: K > 1 of a drafter of token ids takes the tree worker
    monkeypatch.setattr(models, "DEFAULT_DRAFTER_KIND", "standalone")

    methods = parse_methods("specdiff2-k4:drafter_temperature=1.5:gamma=4,ngram", 8)
    assert [m.label for m in methods] == ["plain", "specdiff2-k4:drafter_temperature=1.5:gamma=4",
                                          "ngram"]
    k4 = engine_args(methods[1], Drafters())
    assert k4["worker_cls"] == tree_worker()
    assert k4["speculative_config"]["num_speculative_tokens"] == 4
    section = k4["additional_config"]["specdiff"]
    assert section["num_drafts"] == 4 and section["drafter_temperature"] == 1.5
    assert section["candidates"] == ["argmax", "sample", "ngram"]
    assert engine_args(methods[2], Drafters())["speculative_config"]["num_speculative_tokens"] == 8
    alone = engine_args(parse_methods("specdiff2-nolookup", 8)[1], Drafters())
    assert alone["additional_config"]["specdiff"]["candidates"] == ["argmax", "sample"]
    assert "worker_cls" not in alone  # K = 1: vLLM's own worker
    base = parse_methods("specdiff-base", 8)[1]
    assert base.kind == "specdiff_base" and base.options["candidates"] == ["argmax", "sample"]
    default = engine_args(parse_methods("specdiff2", 8)[1], Drafters())
    assert "candidates" not in default["additional_config"]["specdiff"]  # the plugin default
    dflash = engine_args(parse_methods("dflash:gamma=7", 8)[1], Drafters(dflash="/ckpt"))
    assert dflash == {"speculative_config": {"method": "dflash", "model": "/ckpt",
                                             "num_speculative_tokens": 7}}
    assert parse_value("argmax+sample") == ["argmax", "sample"]
    assert [parse_value(v) for v in ("false", "null", "3", "0.5", "none")] == \
        [False, None, 3, 0.5, "none"]


def _run(outputs: list[list[int]], seconds: float = 1.0) -> Run:
    return Run(seconds=seconds, new_tokens=[len(o) for o in outputs],
               per_request_tps=[1.0] * len(outputs), outputs=outputs)


def test_a_greedy_mismatch_is_reported_and_fails_the_run():
    methods = parse_methods("plain,ngram", 3)
    plain, same, other = _run([[1, 2], [3, 4]]), _run([[1, 2], [3, 4]], 0.5), \
        _run([[1, 2], [3, 5]], 0.5)
    cells = [{"prompts": "p", "temperature": 0.0, "batch_size": 1,
              **summarize(methods[1], [run], [plain], 0.0)} for run in (same, other)]
    assert cells[0]["identical_to_plain"] is True and cells[0]["speedup"] == 2.0
    assert cells[1]["identical_to_plain"] is False and cells[1]["mismatched_prompts"] == [1]
    assert identity_failures(cells) == [
        "ngram on p at batch 1: prompts [1] differ from plain decoding"]
    sampled = {"prompts": "p", "temperature": 1.0, "batch_size": 1,
               **summarize(methods[1], [other], [plain], 1.0)}
    assert sampled["identical_to_plain"] is None and identity_failures([sampled]) == []


def test_base_drafter_is_built_once_into_the_cache(tmp_path, monkeypatch, tiny_verifier):
    from vllm_specdiff import models

    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(models, "prepare_verifier", lambda: tiny_verifier)
    monkeypatch.setattr(models, "DEFAULT_DRAFTER_LAYERS", 1)
    path = models.prepare_base_drafter()
    assert path == tmp_path / "drafters" / models.DRAFTER_NAME
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "specdiff_block_causal"
    assert config["base_config"]["num_hidden_layers"] == 1
    stamp = (path / "config.json").stat().st_mtime_ns
    assert models.prepare_base_drafter() == path
    assert (path / "config.json").stat().st_mtime_ns == stamp


def test_results_table_renders_a_suite_result():
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("results_table",
                                                  root / "scripts" / "results_table.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    cell = {"prompts": "humaneval", "num_prompts": 8, "temperature": 0.0, "batch_size": 4,
            "accepted_per_step": 1.5, "drafter_ms_per_step": 6.0,
            "drafter_share_of_step": 0.2, "identical_to_plain": True}
    result = {"suite": {"methods": [
        {"label": "plain", "kind": "plain", "gamma": None, "options": {}},
        {"label": "specdiff2-k4", "kind": "specdiff", "gamma": 8,
         "options": {"num_drafts": 4, "drafter_temperature": 1.0}}]},
        "cells": [{**cell, "method": "plain", "tokens_per_s": 20.0, "speedup": 1.0},
                  {**cell, "method": "specdiff2-k4", "tokens_per_s": 30.0, "speedup": 1.5}],
        "provenance": {"date": "D", "machine": {"cpu": "C"}}}
    rows = script.suite_rows(root / "benchmarks" / "results" / "x" / "s.json", result)
    assert rows == ["| [s](benchmarks/results/x/s.json) `specdiff2-k4` B=4 | humaneval (8) | 0 "
                    "| 8 | 4 (1) | 20.00 | 30.00 | **1.50x** | 1.50 | 6.0 (20% of step) | yes "
                    "| D, C |"]


def test_plots_group_each_sweep_by_the_settings_it_does_not_vary(tmp_path):
    from vllm_specdiff.bench import plots

    specs = {"plain": 1.0, "specdiff2": 1.1, "specdiff2:quantize=none:gamma=4": 1.2,
             "specdiff2:quantize=none:gamma=8": 1.3, "specdiff2:quantize=none:steps=2": 0.9,
             "specdiff2-k4": 1.4}
    methods = parse_methods(",".join(specs), 8)
    result = {"suite": {"methods": [{"label": m.label, **m.describe()} for m in methods]},
              "cells": [{"prompts": "p", "temperature": 0.0, "batch_size": 1, "method": label,
                         "speedup": speedup, "per_position_acceptance":
                         None if label == "plain" else [0.5, 0.25]}
                        for label, speedup in specs.items()]}
    assert plots._series(result, "gamma", lambda m: plots._family(m, "gamma")) == {
        "specdiff2 {'quantize': 'none'}": {4: 1.2, 8: 1.3}}
    assert plots._series(result, "steps", lambda m: plots._family(m, "steps")) == {
        "specdiff2 {'quantize': 'none', 'gamma': 8}": {1: 1.3, 2: 0.9}}
    written = plots.write_plots(result, tmp_path)
    assert sorted(Path(p).name for p in written) == [
        "acceptance_per_position.png", "gamma_sweep.png", "speedup_by_method.png",
        "speedup_vs_k.png", "steps_sweep.png"]


def test_a_batch_larger_than_the_set_is_announced(capsys):
    from vllm_specdiff.bench.runner import warn_short_sets

    warn_short_sets({"p": [[1], [2]], "q": [[1]] * 4}, [1, 4])
    err = capsys.readouterr().err
    assert "set 'p' has 2 prompts, so batch size(s) [4] run as one batch of 2" in err
    assert "'q'" not in err


class _FakeTimer:
    """A wall clock that only the fake engines move."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _FakeCore:
    """An engine whose request i finishes after `steps[i]` steps with tokens [i] * steps[i];
    each step takes `step_s` seconds of `timer` and is logged (with its request count) into
    `log` under `name`."""

    def __init__(self, steps: list[int], timer: _FakeTimer | None = None, step_s: float = 1.0,
                 name: str = "a", log: list | None = None) -> None:
        self.steps, self.live, self.batches = steps, {}, []
        self.timer, self.step_s, self.name = timer, step_s, name
        self.log = [] if log is None else log

    def add_request(self, request_id, prompt, params):
        index = prompt["prompt_token_ids"][0]
        self.live[request_id] = [index, 0]

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        from types import SimpleNamespace

        if self.timer is not None:
            self.timer.t += self.step_s
        self.batches.append(len(self.live))
        self.log.append(self.name)
        outs = []
        for request_id, state in list(self.live.items()):
            state[1] += 1
            index, done = state
            if done == self.steps[index]:
                del self.live[request_id]
                outs.append(SimpleNamespace(request_id=request_id, finished=True, outputs=[
                    SimpleNamespace(token_ids=[index] * done)]))
        return outs


class _FakeEngine:
    def __init__(self, core: _FakeCore) -> None:
        from types import SimpleNamespace

        from vllm_specdiff.bench.suite import EngineClock

        self.llm = SimpleNamespace(llm_engine=core)
        self.clock = EngineClock(core.timer or _FakeTimer())

    def snapshot(self):
        from vllm_specdiff.bench.counters import ProposerCounts

        return {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                "num_accepted_tokens_per_pos": [], "num_draft_tokens_per_pos": []}, \
            ProposerCounts()


def _lane(core: _FakeCore, concurrency: int, static: bool = False):
    from vllm_specdiff.bench.suite import Lane

    n = len(core.steps)
    return Lane(_FakeEngine(core), [[i] for i in range(n)], [None] * n, concurrency, static)


@pytest.mark.vllm
def test_continuous_batching_refills_each_finished_slot_before_the_next_step():
    from vllm_specdiff.bench.suite import run_lanes

    steps = [3, 1, 1, 2, 1]
    core = _FakeCore(steps, _FakeTimer())
    lane = _lane(core, 2)
    run_lanes([lane], "pass")
    run = Run()
    lane.finish(run)
    # 2 in flight throughout: 1 ends at step 1 and 2 takes its slot, 2 ends at step 2 and 3
    # takes it, 0 ends at step 3 and 4 takes it; batches of 2 would need 3 + 2 + 1 steps
    assert core.batches == [2, 2, 2, 2]
    assert run.outputs == [[i] * n for i, n in enumerate(steps)]
    assert run.new_tokens == steps and run.seconds == 4.0
    # each request's own latency in steps: 0: 3, 1: 1, 2: 1 (steps 2), 3: 2 (3-4), 4: 1 (4)
    assert run.per_request_tps == [(n - 1) / s for n, s in zip(steps, [3, 1, 1, 2, 1],
                                                                strict=True)]


@pytest.mark.vllm
def test_step_interleaving_alternates_engines_and_times_each_on_its_own_steps():
    from vllm_specdiff.bench.suite import run_lanes

    timer, log = _FakeTimer(), []
    fast = _FakeCore([2, 2], timer, step_s=1.0, name="fast", log=log)
    slow = _FakeCore([4, 1], timer, step_s=5.0, name="slow", log=log)
    lanes = [_lane(fast, 2, static=True), _lane(slow, 2, static=True)]
    run_lanes(lanes, "step")
    assert log == ["fast", "slow", "fast", "slow", "slow", "slow"]
    runs = [Run(), Run()]
    for lane, run in zip(lanes, runs, strict=True):
        lane.finish(run)
    # each pass counts only its own engine's steps, though the two ran side by side
    assert [r.seconds for r in runs] == [2.0, 20.0]
    # static: every request's throughput is over its whole batch, as one generate call
    assert runs[1].per_request_tps == [3 / 20.0, 0.0]
    with pytest.raises(ValueError, match="interleave must be one of"):
        run_lanes(lanes, "token")


def test_engine_clock_runs_only_during_its_engine_calls():
    from vllm_specdiff.bench.suite import EngineClock

    timer = _FakeTimer()
    clock = EngineClock(timer)
    timer.t = 10.0  # another engine's step: this clock stands still
    assert clock.now() == 0.0

    def work():
        timer.t += 2.0
        assert clock.now() == 2.0  # what the proposer reads during the step
        return "out"

    assert clock.run(work) == "out"
    timer.t += 7.0
    assert clock.now() == 2.0 and clock.seconds == 2.0


def test_the_specdiff_proposer_in_process_reads_its_engines_clock():
    from types import SimpleNamespace

    from vllm_specdiff.bench.suite import Engine

    proposer = SimpleNamespace(clock=None)
    runner = SimpleNamespace(drafter=proposer)
    executor = SimpleNamespace(driver_worker=SimpleNamespace(
        worker=SimpleNamespace(model_runner=runner)))
    core = SimpleNamespace(model_executor=executor,
                           logger_manager=SimpleNamespace(record=lambda *a, **k: None))
    engine = Engine.of(SimpleNamespace(llm_engine=core))
    assert proposer.clock == engine.clock.now
    # a proposer without a clock (vLLM's ngram) and no in-process worker are left alone
    runner.drafter = SimpleNamespace()
    assert not hasattr(Engine.of(SimpleNamespace(llm_engine=core)).llm.llm_engine
                       .model_executor.driver_worker.worker.model_runner.drafter, "clock")
    Engine.of(SimpleNamespace(llm_engine=SimpleNamespace(logger_manager=core.logger_manager)))


def _quick_bench(out: Path, prompts: Path, verifier: Path, drafter: Path, *options: str
                 ) -> dict:
    """`vllm-specdiff bench --quick` on the tiny models (3 prompts x 8 tokens at batch 2),
    from outside the checkout, writing `out`; its JSON result."""
    cmd = [str(Path(sys.executable).with_name("vllm-specdiff")), "--no-speed-env", "bench",
           "--quick", "--prompts", str(prompts), "--limit", "3", "--batch-size", "2",
           "--max-tokens", "8", "--gamma", str(GAMMA), "--model", str(verifier),
           "--drafter", str(drafter), "--max-model-len", "256", "--json", str(out), *options]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.vllm
def test_step_interleaved_suite_keeps_outputs_identical_and_says_so(
        tmp_path, word_prompts, tiny_verifier, tiny_drafter):
    out = tmp_path / "suite.json"
    result = _quick_bench(out, word_prompts, tiny_verifier, tiny_drafter, "--methods",
                          "plain,specdiff2,specdiff2:adaptive=false", "--interleave", "step")
    assert result["suite"]["interleave"] == "step"
    assert [(c["method"], c["interleave"], c["identical_to_plain"]) for c in result["cells"]] \
        == [(m, "step", True) for m in ("plain", "specdiff2", "specdiff2:adaptive=false")]
    assert all(c["new_tokens"] == 3 * 8 and c["tokens_per_s"] > 0 for c in result["cells"])
    assert result["cells"][2]["drafts"]  # fixed gamma drafted on every decode step
    assert "interleaved step by step" in out.with_suffix(".md").read_text()


def test_passes_are_batches_of_b_or_the_whole_set():
    from vllm_specdiff.bench.suite import passes

    assert passes(5, 2, "static") == [range(0, 2), range(2, 4), range(4, 5)]
    assert passes(5, 2, "continuous") == [range(5)]
    with pytest.raises(ValueError, match="batching must be one of"):
        passes(5, 2, "dynamic")


@pytest.mark.vllm
def test_continuous_suite_keeps_outputs_identical_and_says_how_it_batched(
        tmp_path, word_prompts, tiny_verifier, tiny_drafter):
    out = tmp_path / "suite.json"
    result = _quick_bench(out, word_prompts, tiny_verifier, tiny_drafter, "--methods",
                          "plain,specdiff2", "--batching", "continuous")
    assert result["suite"]["batching"] == "continuous"
    assert [(c["method"], c["batching"], c["identical_to_plain"]) for c in result["cells"]] == \
        [("plain", "continuous", True), ("specdiff2", "continuous", True)]
    assert all(c["new_tokens"] == 3 * 8 for c in result["cells"])
    assert "| 2 (continuous) | `specdiff2` |" in out.with_suffix(".md").read_text()
