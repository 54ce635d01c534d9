"""`ShapeChoice`: chain or best-first tree, whichever commits more tokens per second."""

from __future__ import annotations

import pytest

from vllm_specdiff.adaptive import ShapeChoice


def _serve(choice: ShapeChoice, steps: int, rates: dict[str, tuple[float, float]]) -> list[str]:
    """Run `steps` steps where a shape commits tokens at a fixed cost: (tokens, seconds)."""
    chosen = []
    for _ in range(steps):
        shape = choice.choose()
        chosen.append(shape)
        choice.observe(shape, *rates[shape])
    return chosen


@pytest.mark.parametrize(("faster", "rates"), [
    ("tree", {"tree": (1.9, 0.12), "chain": (1.7, 0.12)}),   # a GPU: the tree costs no more
    ("chain", {"tree": (1.93, 0.124), "chain": (1.68, 0.09)}),  # this CPU's batch-1 figures
])
def test_the_faster_shape_drafts_and_the_other_is_tried_now_and_then(faster, rates):
    choice = ShapeChoice(explore_every=64, trial_steps=4)
    chosen = _serve(choice, 640, rates)
    assert choice.best() == faster
    tail = chosen[64:]
    share = tail.count(faster) / len(tail)
    assert 0.9 < share < 1.0  # exploration keeps measuring the other
    assert choice.stats()["steps"][faster] == chosen.count(faster)


def test_a_change_of_host_is_noticed():
    choice = ShapeChoice(explore_every=16, trial_steps=4)
    _serve(choice, 200, {"tree": (2.0, 0.2), "chain": (1.7, 0.1)})
    assert choice.best() == "chain"
    chosen = _serve(choice, 400, {"tree": (2.0, 0.1), "chain": (1.7, 0.1)})
    assert choice.best() == "tree" and chosen[-100:].count("tree") > 70


def test_both_shapes_are_measured_before_either_is_judged():
    choice = ShapeChoice(trial_steps=3)
    first = [choice.choose() for _ in range(1)]
    assert first == ["chain"] and choice.best() == "tree"  # unmeasured: the tree by default
    choice.observe("chain", 2, 0.1)
    assert choice.stats()["tokens_per_s"] == {"chain": pytest.approx(20.0), "tree": None}


def test_an_unknown_shape_is_refused():
    with pytest.raises(ValueError, match="unknown draft shape 'ring'"):
        ShapeChoice().observe("ring", 1, 0.1)
