"""The bench's step costs: the drafter's share is taken against the verifier part of a step."""

from vllm_specdiff.harness import Comparison


def test_step_costs_split_the_speculative_step():
    c = Comparison(plain_tokens=100, plain_seconds=4.0, spec_tokens=100, spec_seconds=2.0,
                   spec_stats={"proposer": {"propose_calls": 40}, "drafter_ms_per_step": 5.0})
    costs = c.step_costs()
    assert costs == {"plain_step_ms": 40.0, "spec_step_ms": 50.0, "verifier_ms_per_step": 45.0,
                     "drafter_to_verifier": round(5.0 / 45.0, 4)}


def test_step_costs_are_none_without_proposer_stats():
    c = Comparison(plain_tokens=10, plain_seconds=1.0, spec_seconds=1.0)
    assert set(c.step_costs().values()) == {None}
