"""The guarded speed fix that samples a speculative step without any draft token as a plain step
(`GPUModelRunner._sample(logits, None)`) instead of through vLLM's rejection sampler.

Routing (a fake runner): a step without drafts takes the plain path, a step with drafts, a
plain step and a step of a thinking-budget request keep theirs. Semantics (vLLM's own samplers):
on such a step the rejection sampler's output is the plain sampler's, tokens, logprobs and
seeded generator states alike, with penalties; its control, one draft token, moves a seeded
generator. The engine runs are tests/engine/test_draftless_steps.py.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_specdiff.plugin.patches.draftless_fix import (
    fix_draftless_steps,
    plain_when_draftless,
)

pytestmark = pytest.mark.vllm
VOCAB = 40


def _metadata(drafts: list[list[int]]) -> Any:
    """A step's SpecDecodeMetadata laid out as `_calc_spec_decode_metadata` lays it out: each
    request's draft rows, then its bonus row."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    counts = torch.tensor([len(d) for d in drafts], dtype=torch.int32)
    cu_sampled = (counts + 1).cumsum(0).to(torch.int32)
    starts = cu_sampled - counts - 1
    target = [int(s) + j for s, n in zip(starts, counts.tolist(), strict=True) for j in range(n)]
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor([t for d in drafts for t in d], dtype=torch.int32),
        num_draft_tokens=counts.tolist(),
        cu_num_draft_tokens=counts.cumsum(0).to(torch.int32),
        cu_num_sampled_tokens=cu_sampled,
        target_logits_indices=torch.tensor(target, dtype=torch.int32),
        bonus_logits_indices=cu_sampled - 1,
        logits_indices=torch.arange(int(cu_sampled[-1]), dtype=torch.int32),
    )


class _Holder:
    def __init__(self, tracked: bool) -> None:
        self.tracked = tracked

    def has_tracked_requests(self) -> bool:
        return self.tracked


def _fake_runner(holder: _Holder | None = None) -> SimpleNamespace:
    """What vLLM's `_sample` reads of a runner; its two samplers record their calls."""
    calls: list[str] = []
    batch = SimpleNamespace(sampling_metadata=SimpleNamespace(thinking_budget_state_holder=holder),
                            update_async_output_token_ids=lambda: None)
    return SimpleNamespace(
        calls=calls, input_batch=batch, use_async_scheduling=False,
        sampler=lambda logits, sampling_metadata: calls.append("plain") or "plain",
        rejection_sampler=lambda meta, probs, logits, sm: calls.append("rejection") or "rej",
        _get_spec_decode_draft_probs=lambda meta: None,
    )


def _vllm_sample() -> Any:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    current = GPUModelRunner._sample
    return getattr(current, "specdiff_wraps", current)


def test_a_step_without_drafts_takes_the_plain_path_and_others_keep_theirs():
    fixed = plain_when_draftless(_vllm_sample())
    logits = torch.zeros(3, VOCAB)
    cases = [(_metadata([[], [], []]), "plain"), (_metadata([[], [5], []]), "rejection"),
             (None, "plain")]
    for meta, path in cases:
        runner = _fake_runner()
        fixed(runner, logits, meta)
        assert runner.calls == [path]
        own = _fake_runner()
        _vllm_sample()(own, logits, meta)  # control: vLLM's own routes every metadata to rejection
        assert own.calls == ["plain" if meta is None else "rejection"]
    tracked = _fake_runner(_Holder(tracked=True))
    fixed(tracked, logits, _metadata([[], [], []]))
    assert tracked.calls == ["rejection"]  # thinking budget: the spec-mode forcing rows
    untracked = _fake_runner(_Holder(tracked=False))
    fixed(untracked, logits, _metadata([[], [], []]))
    assert untracked.calls == ["plain"]


@pytest.fixture
def samplers() -> tuple[Any, Any]:
    """vLLM's Sampler and a RejectionSampler around it, with the CPU kernels registered and
    the plugin's other fixes installed, as in an engine (top-k only fails on the empty draft
    batch without `topk_fix`)."""
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    from vllm_specdiff.plugin.vllm_plugin import install_vllm_fixes

    current_platform.import_kernels()
    current_platform.register_triton_kernel_overrides()
    install_vllm_fixes()
    sampler = Sampler()
    return sampler, RejectionSampler(sampler)


def _sampling_metadata(rows: int, seeds: dict[int, int],
                       logprobs: int | None) -> Any:
    """Temperature 1, top-k 7 on row 0, penalties on every row, past output tokens."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    top_k = torch.full((rows,), VOCAB, dtype=torch.int32)
    top_k[0] = 7
    return SamplingMetadata(
        temperature=torch.ones(rows), all_greedy=False, all_random=True, top_p=None, top_k=top_k,
        generators={i: torch.Generator().manual_seed(s) for i, s in seeds.items()},
        max_num_logprobs=logprobs, no_penalties=False,
        prompt_token_ids=torch.randint(0, VOCAB, (rows, 5),
                                       generator=torch.Generator().manual_seed(9)),
        frequency_penalties=torch.full((rows,), 0.5), presence_penalties=torch.full((rows,), 0.3),
        repetition_penalties=torch.full((rows,), 1.2),
        output_token_ids=[[1, 2, 2], [3], [4, 4, 5]], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
        spec_token_ids=[[] for _ in range(rows)],
    )


def test_without_drafts_the_rejection_sampler_returns_the_plain_samplers_output(samplers):
    sampler, rejection = samplers
    seeds = {0: 11, 2: 12}
    for trial in range(5):
        logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(trial)) * 2
        plain_meta = _sampling_metadata(3, seeds, logprobs=2)
        plain = sampler(logits=logits.clone(), sampling_metadata=plain_meta)
        spec_meta = _sampling_metadata(3, seeds, logprobs=2)
        spec = rejection(_metadata([[], [], []]), None, logits.clone(), spec_meta)
        assert spec.sampled_token_ids.shape == plain.sampled_token_ids.shape == (3, 1)
        assert spec.sampled_token_ids.dtype == plain.sampled_token_ids.dtype
        seeded = list(seeds)
        assert torch.equal(spec.sampled_token_ids[seeded], plain.sampled_token_ids[seeded])
        for i in seeded:
            assert torch.equal(spec_meta.generators[i].get_state(),
                               plain_meta.generators[i].get_state())
        spec_lp, plain_lp = spec.logprobs_tensors, plain.logprobs_tensors
        assert torch.equal(spec_lp.logprob_token_ids[seeded], plain_lp.logprob_token_ids[seeded])
        torch.testing.assert_close(spec_lp.logprobs[seeded], plain_lp.logprobs[seeded])
        assert torch.equal(spec_lp.selected_token_ranks[seeded],
                           plain_lp.selected_token_ranks[seeded])
    # control: a draft token on row 0 makes the rejection sampler draw from its generator
    drafted_meta = _sampling_metadata(3, seeds, logprobs=None)
    drafted_meta.spec_token_ids = [[5], [], []]
    rejection(_metadata([[5], [], []]), None, torch.randn(4, VOCAB), drafted_meta)
    fresh = _sampling_metadata(3, seeds, logprobs=None)
    sampler(logits=torch.randn(3, VOCAB), sampling_metadata=fresh)
    assert not torch.equal(drafted_meta.generators[0].get_state(),
                           fresh.generators[0].get_state())
    assert torch.equal(drafted_meta.generators[2].get_state(), fresh.generators[2].get_state())


def test_install_is_idempotent_and_a_changed_layout_only_warns(monkeypatch, caplog):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    fix_draftless_steps()
    installed = GPUModelRunner._sample
    assert hasattr(installed, "specdiff_wraps")
    assert fix_draftless_steps() is False  # already installed: not wrapped twice
    assert GPUModelRunner._sample is installed

    def other_layout(self, logits, spec_decode_metadata, extra):  # noqa: ANN001, ANN202
        return None

    monkeypatch.setattr(GPUModelRunner, "_sample", other_layout)
    with caplog.at_level(logging.WARNING, logger="vllm.specdiff"):
        assert fix_draftless_steps() is False
    assert GPUModelRunner._sample is other_layout  # left as it was
    assert "could not be checked" in caplog.text


# ---- engine -------------------------------------------------------------------------------------
