"""benchmarks/step_trace.py: each scheduled step's kind and the per-kind totals."""

from vllm_specdiff_benchmarks.step_trace import step_kind, summarize


def _step(t: float, tokens: int, reqs: int, spec: int = 0, new: int = 0) -> dict:
    return {"t": t, "tokens": tokens, "reqs": reqs, "spec": spec, "new": new}


def test_steps_are_sorted_into_prefill_drafts_and_decode():
    assert step_kind(_step(0, 16, 16)) == "decode"
    assert step_kind(_step(0, 40, 16, spec=24)) == "drafts"
    assert step_kind(_step(0, 140, 16, spec=4)) == "prefill"  # a prompt chunk rides along
    assert step_kind(_step(0, 16, 16, new=1)) == "prefill"  # a new request (a cached prompt)


def test_each_step_is_timed_to_the_next_and_long_gaps_are_not_steps():
    steps = [_step(0.0, 16, 16), _step(0.1, 40, 16, spec=24), _step(0.35, 300, 16, new=2),
             _step(1.0, 16, 16), _step(5.0, 16, 16), _step(5.1, 0, 0)]
    out = summarize(steps)
    assert out["decode"] == {"steps": 2, "seconds": 0.2, "mean_ms": 100.0, "mean_tokens": 16.0,
                             "mean_rows": 16.0, "mean_draft_tokens": 0.0}
    assert out["drafts"]["steps"] == 1 and out["drafts"]["mean_ms"] == 250.0
    assert out["prefill"]["seconds"] == 0.65 and out["prefill"]["mean_tokens"] == 300.0


def test_step_interleaved_bench_runs_are_refused(tmp_path, capsys):
    import pytest

    from vllm_specdiff_benchmarks.step_trace import interleave_option, main

    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "t.json"), "--no-speed-env", "--", "--interleave", "step"])
    assert "use the default --interleave pass" in capsys.readouterr().err
    assert interleave_option(["--limit", "4", "--interleave=step"]) == "step"
    assert interleave_option(["--interleave", "pass"]) == "pass"
    assert interleave_option(["--batching", "continuous"]) is None
