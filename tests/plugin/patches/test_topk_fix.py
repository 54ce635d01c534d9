"""The guarded fix of vLLM 0.32's CPU top-k-only sampler on a step with no draft tokens: vLLM's
own function fails on an empty batch (the bug is real), the wrapper passes an empty batch
through and leaves every other batch to vLLM, and the install is guarded. The engine-level case
(top-k sampling with speculation) runs in test_sampling_distribution.py's lookup tests."""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_specdiff.plugin.patches.topk_fix import empty_safe, fails_on_empty, fix_cpu_top_k_only

pytestmark = pytest.mark.vllm


def _vllm_own():
    from vllm.v1.sample.ops import topk_topp_sampler

    current = topk_topp_sampler.apply_top_k_only
    return getattr(current, "specdiff_wraps", current)


def test_vllm_top_k_only_fails_on_an_empty_batch_and_the_wrapper_does_not():
    own = _vllm_own()
    assert fails_on_empty(own)
    fixed = empty_safe(own)
    assert not fails_on_empty(fixed)
    empty = torch.zeros(0, 6)
    assert fixed(empty, torch.zeros(0, dtype=torch.long)) is empty


def test_the_wrapper_masks_as_vllm_does_on_other_batches():
    own = _vllm_own()
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    k = torch.tensor([2, 7, 1])
    torch.testing.assert_close(empty_safe(own)(logits.clone(), k.clone()),
                               own(logits.clone(), k.clone()))
    assert int(torch.isfinite(empty_safe(own)(logits.clone(), k.clone())[0]).sum()) == 2


def test_install_is_idempotent_and_a_changed_layout_only_warns(monkeypatch, caplog):
    from vllm.v1.sample.ops import topk_topp_sampler

    fix_cpu_top_k_only()
    assert hasattr(topk_topp_sampler.apply_top_k_only, "specdiff_wraps")
    assert fix_cpu_top_k_only() is False  # already installed: not wrapped twice
    monkeypatch.delattr(topk_topp_sampler, "apply_top_k_only")
    with caplog.at_level(logging.WARNING, logger="vllm.specdiff"):
        assert fix_cpu_top_k_only() is False
    assert "could not be checked" in caplog.text
