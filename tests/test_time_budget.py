"""The time-budget benchmark's pure parts: which tokens a budget keeps, the answer a finish
states, and the accuracy table (benchmarks/time_budget.py; the engine run is in tests/engine)."""

import argparse
import sys

import pytest

from vllm_specdiff_benchmarks import time_budget as tb


def _run(times, eos=False):
    return tb.TimedRun(tokens=list(range(10, 10 + len(times))), times=times, eos=eos,
                       wall_s=times[-1] if times else 0.0)


def test_budget_keeps_the_tokens_that_had_appeared_by_then():
    # A speculative step's tokens appear together (same time); a token at exactly b counts.
    run = _run([0.5, 1.0, 1.0, 1.0, 2.5, 4.0])
    assert tb.tokens_within(run, 0.4) == []
    assert tb.tokens_within(run, 0.5) == [10]
    assert tb.tokens_within(run, 0.99) == [10]
    assert tb.tokens_within(run, 1.0) == [10, 11, 12, 13]
    assert tb.tokens_within(run, 3.0) == [10, 11, 12, 13, 14]
    assert tb.tokens_within(run, 16.0) == run.tokens


def test_partial_answer_drops_a_closing_eos_only_once_the_answer_is_complete():
    done = _run([0.1, 0.2, 0.3], eos=True)
    assert tb.partial_answer(done, 0.2) == [10, 11]  # cut by the budget: nothing dropped
    assert tb.partial_answer(done, 5.0) == [10, 11]  # finished: the EOS (12) is dropped
    cut = _run([0.1, 0.2, 0.3], eos=False)
    assert tb.partial_answer(cut, 5.0) == [10, 11, 12]


def test_timed_run_rejects_inconsistent_times():
    with pytest.raises(ValueError, match="decrease"):
        _run([0.2, 0.1])
    with pytest.raises(ValueError, match="one time per token"):
        tb.TimedRun(tokens=[1, 2], times=[0.1], eos=False, wall_s=0.1)


@pytest.mark.parametrize("finish, answer", [
    (" 42.", "42"),
    (" The final answer is 42.", "42"),
    (" $1,234.", "1234"),
    (" $1,234.50 in total", "1234.50"),
    (" \\boxed{7}.", "7"),
    (" 3 apples, so \\boxed{12}", "12"),     # boxed wins over the first number
    (" #### 18", "18"),
    (" 18 dollars. She had 20 before.", "18"),  # the first number follows "answer is"
    (" -5 degrees", "-5"),
    (" 0.5.", "0.5"),
    (" 12,34", "12"),                        # not a thousands group
    (" w280 w220", None),                    # digits inside words are no number
    (" eighteen", None),
])
def test_extract_answer(finish, answer):
    assert tb.extract_answer(finish) == answer


def test_is_correct_compares_numbers():
    assert tb.is_correct("18", "18") and tb.is_correct("18.0", "18")
    assert tb.is_correct("1234", "1,234")
    assert not tb.is_correct("17", "18")
    assert not tb.is_correct(None, "18")


def _record(cells):
    return {"methods": {m: {"budgets": {k: {"correct": c, "tokens": n}
                                        for k, (c, n) in row.items()}}
                        for m, row in cells.items()}}


def test_accuracy_table_counts_per_method_and_budget():
    records = [_record({"plain": {"1": (False, 10), "2": (True, 20)},
                        "specdiff2": {"1": (True, 30), "2": (True, 40)}}),
               _record({"plain": {"1": (False, 12), "2": (False, 24)},
                        "specdiff2": {"1": (False, 36), "2": (True, 48)}})]
    table = tb.accuracy_table(records, ["plain", "specdiff2"], [1.0, 2.0])
    assert table["plain"]["1"] == {"accuracy": 0.0, "correct": 0, "questions": 2,
                                   "mean_tokens": 11.0}
    assert table["plain"]["2"]["accuracy"] == 0.5
    assert table["specdiff2"]["1"]["correct"] == 1
    assert table["specdiff2"]["2"] == {"accuracy": 1.0, "correct": 2, "questions": 2,
                                       "mean_tokens": 44.0}


def test_greedy_mismatch_is_a_departure_from_plain_where_both_ran():
    def record(qid, **tokens):
        return {"id": qid, "methods": {m: {"tokens": t} for m, t in tokens.items()}}

    records = [record("a", plain=[1, 2, 3], specdiff2=[1, 2]),        # cut earlier: fine
               record("b", plain=[1, 2], specdiff2=[1, 2, 3, 4]),     # plain cut earlier
               record("c", plain=[1, 2, 3], specdiff2=[1, 5, 3]),
               record("d", specdiff2=[9])]                            # no plain: no reference
    assert tb.greedy_mismatches(records) == ["c:specdiff2"]


def test_options_are_checked():
    assert tb.parse_budgets("4,1,2") == [1.0, 2.0, 4.0]
    for bad in ("", "1,x", "0,1", "1,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            tb.parse_budgets(bad)
    assert tb.parse_methods("plain,specdiff2") == ["plain", "specdiff2"]
    for bad in ("plain,plain", "eagle", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            tb.parse_methods(bad)
    with pytest.raises(SystemExit):
        tb.main(["--limit", "0", "--no-speed-env"])


def test_quick_fills_only_what_was_not_given():
    args = tb.resolve_defaults(tb.build_parser().parse_args(["--quick", "--limit", "5"]))
    assert (args.limit, args.budgets, args.max_tokens, args.finish_tokens) == \
        (5, list(tb.QUICK[1]), tb.QUICK[2], tb.QUICK[3])
    full = tb.resolve_defaults(tb.build_parser().parse_args([]))
    assert full.budgets == list(tb.DEFAULTS[1]) and full.limit == tb.DEFAULTS[0]


def test_methods_take_turns_going_first():
    methods = ["plain", "specdiff-base", "specdiff2"]
    firsts = [tb.method_order(methods, i)[0] for i in range(6)]
    assert firsts == methods * 2
    assert sorted(tb.method_order(methods, 1)) == sorted(methods)


def test_the_script_reexecutes_itself_as_its_module(monkeypatch):
    from vllm_specdiff.plugin import cpu_env

    calls = []
    monkeypatch.delenv(cpu_env.APPLIED_FLAG, raising=False)
    monkeypatch.setattr(cpu_env, "recommended_env", lambda env: {"LD_PRELOAD": "libx.so"})
    monkeypatch.setattr(cpu_env.os, "execve", lambda exe, argv, env: calls.append(argv))
    monkeypatch.setattr(tb, "run_experiment", lambda args: (_ for _ in ()).throw(
        ValueError("stop here")))
    assert tb.main(["--quick"]) == 2
    assert calls == [[sys.executable, "-P", "-m", "vllm_specdiff_benchmarks.time_budget",
                      "--quick"]]


def test_benchmark_scripts_record_the_command_that_ran_them():
    from vllm_specdiff_benchmarks import invocation

    assert invocation("vllm_specdiff_benchmarks.time_budget", ["--quick"]) == [
        "python", "-m", "vllm_specdiff_benchmarks.time_budget", "--quick"]
