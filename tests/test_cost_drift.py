"""benchmarks/cost_drift.py: window medians per token count and their spread."""

from vllm_specdiff_benchmarks.cost_drift import MIN_STEPS, spreads, windows


def test_windows_take_each_token_counts_median_and_spreads_need_enough_steps():
    fast = [(1, 5, 0.030)] * MIN_STEPS + [(1, 9, 0.050)]
    slow = [(1, 5, 0.036)] * MIN_STEPS + [(1, 9, 0.040)]
    table = windows(fast + slow, MIN_STEPS + 1)
    assert table == [{5: (30.0, MIN_STEPS), 9: (50.0, 1)}, {5: (36.0, MIN_STEPS), 9: (40.0, 1)}]
    # 9 tokens: one step per window, too few for a median to count
    assert spreads(table) == {5: 1.2}
