"""Adaptive drafting's options and the proposer's wiring to the controller (no engine).

The controller itself is tested without vLLM in tests/adaptive."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.adaptive.simulate import GAMMA, static_batch_ends
from vllm_specdiff.adaptive import DRAFT_MARGIN, AdaptiveDrafting, Plan, TailCredit, choose
from vllm_specdiff.plugin.config import SpecDiffConfig, parse_specdiff_config


def test_adaptive_option_defaults_on_and_takes_only_booleans():
    assert SpecDiffConfig().adaptive is True
    assert parse_specdiff_config({"specdiff": {"adaptive": False}}).adaptive is False
    for bad in (1, 0, "false", None):
        with pytest.raises(ValueError, match=r"\['adaptive'\] must be true or false"):
            parse_specdiff_config({"specdiff": {"adaptive": bad}})


def test_draft_margin_option_reaches_the_controller(tiny_drafter):
    from tests.plugin.test_options import _proposer

    assert _proposer(tiny_drafter, 256, draft_margin=0.25).adaptive.margin == 0.25
    assert SpecDiffConfig().draft_margin == DRAFT_MARGIN
    assert parse_specdiff_config({"specdiff": {"draft_margin": 0}}).draft_margin == 0.0
    for bad in (-0.1, True, "0.1", None, float("inf")):
        with pytest.raises(ValueError, match=r"\['draft_margin'\] must be a finite number"):
            parse_specdiff_config({"specdiff": {"draft_margin": bad}})
    rates = {0: 100.0, 2: 105.0}
    assert AdaptiveDrafting(GAMMA, margin=0.0).margin == 0.0
    assert choose(rates, rows=16, margin=0.0) == 2 and choose(rates, rows=16, margin=0.1) == 0


def test_refill_ratio_option_pins_the_controller_and_is_checked(tiny_drafter):
    from tests.plugin.test_options import _proposer

    assert _proposer(tiny_drafter, 256, refill_ratio=0.25).adaptive.refill_ratio() == 0.25
    assert _proposer(tiny_drafter, 256).adaptive.pinned_refill is None
    assert SpecDiffConfig().refill_ratio is None
    assert parse_specdiff_config({"specdiff": {"refill_ratio": 1}}).refill_ratio == 1.0
    ctrl = AdaptiveDrafting(GAMMA, lookup=True, refill_ratio=0.5)
    static_batch_ends(ctrl)
    assert ctrl.refill_ratio() == 0.5 and ctrl.refills.ratio() < 0.1
    for bad in (-0.1, 1.5, True, "1"):
        with pytest.raises(ValueError, match=r"\['refill_ratio'\] must be null \(measured\) or "
                                             r"a number in \[0, 1\]"):
            parse_specdiff_config({"specdiff": {"refill_ratio": bad}})


def test_proposer_feeds_the_controller_and_skips_the_drafter(tiny_drafter, monkeypatch):
    """g = 0 does not call the drafter; the verifier is timed against the tokens it verified
    (rows + their drafts) and the drafter against the tokens it encoded (unseen context +
    draft); a prefill step (a new row) is not a verifier sample."""
    import numpy as np

    from tests.plugin.test_options import _proposer

    plans = iter([Plan(4), Plan(0), Plan(0), Plan(0, probe_rows=1, probe_gamma=4), Plan(0)])
    monkeypatch.setattr(AdaptiveDrafting, "plan", lambda self, *args, **kwargs: next(plans))
    seen: dict[str, list] = {"verifier": [], "drafter": []}
    monkeypatch.setattr(AdaptiveDrafting, "observe_verifier",
                        lambda self, rows, tokens, s: seen["verifier"].append((rows, tokens)))
    monkeypatch.setattr(AdaptiveDrafting, "observe_drafter",
                        lambda self, tokens, s: seen["drafter"].append(tokens))
    proposer = _proposer(tiny_drafter, 256, gamma=4)
    proposer.load_model(None)
    calls = []
    draft_logits = proposer.drafter.draft_logits
    proposer.drafter.draft_logits = lambda ctx, n, **kw: calls.append(len(ctx)) or draft_logits(
        ctx, n, **kw)
    rng = np.random.default_rng(0)
    tokens = rng.integers(5, 300, size=(3, 256))
    lengths = np.array([10, 20, 30])
    out = []
    for _ in range(5):
        drafts = proposer.propose([[int(tokens[r, lengths[r] - 1])] for r in range(3)],
                                  lengths.copy(), tokens)
        out.append([len(d) for d in drafts])
        lengths = lengths + 1  # each row commits one token (no draft accepted)
    assert out == [[4, 4, 4], [0, 0, 0], [0, 0, 0], [4, 0, 0], [0, 0, 0]]
    assert calls == [3, 1]  # the drafter ran only on the two drafting steps
    # step 1 prefilled (no sample); then 3 rows + 12 draft tokens, 3, 3, 3 + 4
    assert seen["verifier"] == [(3, 15), (3, 3), (3, 3), (3, 7)]
    # 10 + 20 + 30 unseen context tokens + 3 drafts of 4; the probe row caught up on 3 tokens
    assert seen["drafter"] == [72, 3 + 4]
    assert proposer.get_stats()["verify_steps"] == 4  # the drafted rows of steps 1 and 4


def _three_rows_planned_by(plan: Callable, tiny_drafter, monkeypatch) -> tuple:
    """A proposer (gamma 4) whose controller plans with `plan`, and three rows' token array and
    committed lengths (10, 20, 30) to call it with."""
    import numpy as np

    from tests.plugin.test_options import _proposer

    monkeypatch.setattr(AdaptiveDrafting, "plan", plan)
    proposer = _proposer(tiny_drafter, 256, gamma=4)
    proposer.load_model(None)
    tokens = np.random.default_rng(0).integers(5, 300, size=(3, 256))
    return proposer, tokens, np.array([10, 20, 30])


def test_proposer_tells_the_controller_which_rows_are_at_the_back(tiny_drafter, monkeypatch):
    """Each row's progress counts from the step its request arrived: a row committing three
    tokens a step pulls ahead of two committing one and loses its `TailCredit` at gamma ahead."""
    import numpy as np

    credits = []

    def plan(self: AdaptiveDrafting, rows: int, lookup_rows: int | None = None,
             credit: TailCredit | None = None, *catch_up: float | None) -> Plan:
        credits.append(credit)
        return Plan(0)

    proposer, tokens, lengths = _three_rows_planned_by(plan, tiny_drafter, monkeypatch)
    for step in range(3):
        sampled = [3 if r == 0 and step else 1 for r in range(3)]
        proposer.propose([[int(t) for t in tokens[r, lengths[r] - sampled[r]:lengths[r]]]
                          for r in range(3)], lengths.copy(), tokens)
        lengths = lengths + np.array([3, 1, 1])
    assert credits == [TailCredit(0.0, 3.0, 0, 3), TailCredit(0.0, 2.5, 0, 2),
                       TailCredit(0.0, 2.0, 0, 2)]


def test_proposer_tells_the_controller_what_the_drafter_rows_must_catch_up_on(tiny_drafter,
                                                                              monkeypatch):
    """The mean context the drafter has not encoded per row, and the probe row's (the least):
    a fresh row's whole context, one token a step for a row drafted last step."""
    plans = iter([Plan(0), Plan(4), Plan(0)])
    seen = []

    def plan(self: AdaptiveDrafting, rows: int, lookup_rows: int | None = None,
             credit: TailCredit | None = None, catch_up: float | None = None,
             probe_catch_up: float | None = None) -> Plan:
        seen.append((catch_up, probe_catch_up))
        return next(plans)

    proposer, tokens, lengths = _three_rows_planned_by(plan, tiny_drafter, monkeypatch)
    for _ in range(3):
        proposer.propose([[int(tokens[r, lengths[r] - 1])] for r in range(3)], lengths.copy(),
                         tokens)
        lengths = lengths + 1
    assert seen == [(20.0, 10), (21.0, 11), (1.0, 1)]


def test_rows_with_identical_contexts_each_keep_their_step(tiny_drafter, monkeypatch):
    """Greedy n > 1 gives rows with identical contexts: each is matched to its own last step, so
    the step still counts as decode-only and is timed."""
    import numpy as np

    from tests.plugin.test_options import _proposer

    monkeypatch.setattr(AdaptiveDrafting, "plan", lambda self, *args, **kwargs: Plan(4))
    seen = []
    monkeypatch.setattr(AdaptiveDrafting, "observe_verifier",
                        lambda self, rows, tokens, s: seen.append(tokens))
    proposer = _proposer(tiny_drafter, 256, gamma=4)
    proposer.load_model(None)
    tokens = np.tile(np.arange(5, 45), (2, 1))
    for n in (20, 21):
        proposer.propose([[int(tokens[0, n - 1])]] * 2, np.array([n, n]), tokens)
    assert seen == [2 * (1 + 4)]
    assert proposer.get_stats()["verify_steps"] == 2


def test_load_model_warms_the_drafter_up_and_leaves_no_trace(tiny_drafter, monkeypatch):
    """load_model runs one full-gamma draft (the drafter's first call pays one-time costs) that
    reaches neither the cost model, the proposer's counters, the KV pool nor the sampling
    generator: the first real drafts equal those of a proposer that skipped the warm-up."""
    import numpy as np

    from tests.plugin.test_options import _proposer
    from vllm_specdiff.drafter.base import Drafter
    from vllm_specdiff.plugin.proposer import SpecDiffProposer

    monkeypatch.setattr(AdaptiveDrafting, "plan", lambda self, *args, **kwargs: Plan(4))
    observed = []
    monkeypatch.setattr(AdaptiveDrafting, "observe_drafter",
                        lambda self, tokens, s: observed.append(tokens))
    calls = []
    draft_logits = Drafter.draft_logits
    monkeypatch.setattr(Drafter, "draft_logits", lambda self, ctx, n, **kw: calls.append(
        (len(ctx), n)) or draft_logits(self, ctx, n, **kw))
    warm = _proposer(tiny_drafter, 256, gamma=4, drafter_temperature=1.0, seed=3)
    warm.load_model(None)
    assert calls == [(1, 4)]
    assert observed == [] and warm.propose_calls == 0 and warm.drafter_seconds == 0.0
    assert warm.drafter.cache_stats()["entries"] == 0
    assert warm.drafter.cache_stats()["miss_tokens"] == 0
    monkeypatch.setattr(SpecDiffProposer, "_warm_up", lambda self: None)
    cold = _proposer(tiny_drafter, 256, gamma=4, drafter_temperature=1.0, seed=3)
    cold.load_model(None)
    tokens = np.random.default_rng(1).integers(5, 300, size=(2, 64))
    lengths = np.array([20, 30])
    for proposer in (warm, cold):
        proposer.drafts = proposer.propose([[int(tokens[r, lengths[r] - 1])] for r in range(2)],
                                           lengths.copy(), tokens)
    assert warm.drafts == cold.drafts and all(len(d) == 4 for d in warm.drafts)
    assert warm.drafter.cache_stats() == cold.drafter.cache_stats()


def test_lookup_rows_follow_the_lookup_length_and_report_their_source(tiny_drafter,
                                                                      monkeypatch):
    """With lookup on, a row whose context repeats drafts `plan.lookup_gamma` tokens of its
    continuation (even when the drafter's length is 0), the probe goes to a drafter row, and its
    accepted length reaches the controller flagged as a lookup draft."""
    import numpy as np

    from tests.plugin.test_options import _proposer

    plans = iter([Plan(0, probe_rows=1, probe_gamma=4, lookup_gamma=3), Plan(0, lookup_gamma=2)])
    monkeypatch.setattr(AdaptiveDrafting, "plan", lambda self, *args, **kwargs: next(plans))
    observed = []
    monkeypatch.setattr(AdaptiveDrafting, "observe_accepted",
                        lambda self, a, d, lookup=None: observed.append((a, d, lookup)))
    proposer = _proposer(tiny_drafter, 256, gamma=4, candidates=["argmax", "sample", "ngram"])
    proposer.load_model(None)
    tokens = np.zeros((3, 64), dtype=np.int64)
    tokens[0, :12] = [7, 8, 9, 10, 11, 12, 13, 14, 15, 7, 8, 9]  # [7, 8, 9] repeats
    tokens[1, :12] = np.arange(20, 32)
    tokens[2, :12] = np.arange(40, 52)
    lengths = np.array([12, 12, 12])
    first = proposer.propose([[9], [31], [51]], lengths, tokens)
    assert first[0] == [10, 11, 12]  # lookup_gamma tokens of the continuation
    assert [len(d) for d in first[1:]] == [4, 0]  # one drafter row probes, the other waits
    # row 0 accepts 2 of its lookup draft, row 1 none of its drafter draft
    tokens[0, 12:15] = [10, 11, 99]
    tokens[1, 12] = 77
    tokens[2, 12] = 88
    second = proposer.propose([[10, 11, 99], [77], [88]], np.array([15, 13, 13]), tokens)
    assert observed == [([2, 0], [3, 4], [True, False])]
    assert second[0] == [] and second[1:] == [[], []]  # no match after 99; drafter length 0
    assert proposer.get_stats()["lookup_drafts"] == 1
