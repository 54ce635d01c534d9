"""The guarded speed fix of vLLM 0.32's recovered-token sampling on steps without draft tokens:
vLLM's own function draws a (rows x vocabulary) random tensor even then, the wrapper returns
the same empty result without drawing, leaves steps with drafts to vLLM (identical tokens with
seeded rows), and the install is guarded. The engine-level check that sampling stays the
verifier's distribution at T > 0 is test_sampling_distribution.py (the proposer installs it)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from vllm_specdiff.plugin.recovered_fix import (
    fix_recovered_tokens_without_drafts,
    skip_without_drafts,
)

pytestmark = pytest.mark.vllm
VOCAB = 50


def _vllm_own():
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    current_platform.import_kernels()  # the C++ kernels, registered as a CPU worker does
    current_platform.register_triton_kernel_overrides()
    current = rejection_sampler.sample_recovered_tokens
    return getattr(current, "specdiff_wraps", current)


def _args(num_draft_tokens: list[int], seed: int = 0) -> tuple:
    rows = len(num_draft_tokens)
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor(num_draft_tokens, dtype=torch.int32).cumsum(0).to(torch.int32)
    tokens = int(sum(num_draft_tokens))
    draft = torch.randint(0, VOCAB, (tokens,), generator=gen)
    target = torch.softmax(torch.randn(tokens, VOCAB, generator=gen), -1)
    metadata = SimpleNamespace(generators={i: torch.Generator().manual_seed(100 + i)
                                           for i in range(rows)})
    return (max(num_draft_tokens + [1]), num_draft_tokens, cu, draft, None, target, metadata,
            torch.device("cpu"), False)


def test_a_step_without_drafts_returns_empty_and_draws_nothing(monkeypatch):
    own = _vllm_own()
    args = _args([0, 0, 0])
    assert own(*args).numel() == 0  # vLLM's own result: empty, after drawing 3 x VOCAB
    draws = []
    monkeypatch.setattr(torch.Tensor, "exponential_",
                        lambda self, *a, **k: draws.append(self.shape) or self)
    out = skip_without_drafts(own)(*_args([0, 0, 0]))
    assert out.numel() == 0 and out.dtype == args[3].dtype and draws == []
    own(*_args([0, 0, 0]))
    assert draws  # negative control: vLLM's own function does draw


def test_steps_with_drafts_are_left_to_vllm():
    own = _vllm_own()
    fixed = skip_without_drafts(own)
    for counts in ([2, 0, 3], [1, 1, 1], [0, 4, 0]):
        torch.testing.assert_close(fixed(*_args(counts, seed=1)), own(*_args(counts, seed=1)))


def test_install_is_idempotent_and_a_changed_layout_only_warns(monkeypatch, caplog):
    from vllm.v1.sample import rejection_sampler

    fix_recovered_tokens_without_drafts()
    assert hasattr(rejection_sampler.sample_recovered_tokens, "specdiff_wraps")
    assert fix_recovered_tokens_without_drafts() is False  # not wrapped twice
    monkeypatch.setattr(rejection_sampler, "sample_recovered_tokens", lambda a, b: None)
    with caplog.at_level(logging.WARNING, logger="vllm.specdiff"):
        assert fix_recovered_tokens_without_drafts() is False
    assert "could not be checked" in caplog.text
