"""Options that only an engine can reject start no engine: a bad option, too many speculative
tokens, another verifier without a drafter; and the CPU kernel fix survives a later engine."""

from __future__ import annotations

import pytest


@pytest.mark.vllm
def test_bad_option_fails_engine_start(tiny_verifier):
    from vllm import LLM

    with pytest.raises(Exception, match="'drafter_temperature'") as info:
        LLM(model=str(tiny_verifier), max_model_len=128, kv_cache_memory_bytes=2**20,
            enforce_eager=True, dtype="float32",
            speculative_config={"model": "vllm_specdiff.SpecDiffProposer",
                                "num_speculative_tokens": 2},
            additional_config={"specdiff": {"drafter_temperature": -1.0}})
    assert "must be a finite number >= 0" in str(info.value)


@pytest.mark.vllm
def test_cpu_fix_survives_a_later_engine(tiny_verifier):
    """A worker started after the fix re-registers vLLM's kernels; it must get the fixed one."""
    from vllm import LLM
    from vllm.triton_utils import dispatcher

    from vllm_specdiff.plugin.patches.cpu_fixes import (
        KERNEL,
        expand_any_dtype,
        fix_cpu_expand_kernel,
    )

    fix_cpu_expand_kernel()
    LLM(model=str(tiny_verifier), max_model_len=128, kv_cache_memory_bytes=2**20,
        enforce_eager=True, dtype="float32")
    assert dispatcher._registry[KERNEL][1] is expand_any_dtype


@pytest.mark.vllm
def test_too_many_speculative_tokens_fail_engine_start(tiny_verifier, tiny_drafter):
    from vllm import LLM
    from vllm.v1.sample.rejection_sampler import MAX_SPEC_LEN

    with pytest.raises(Exception, match=f"MAX_SPEC_LEN = {MAX_SPEC_LEN}"):
        LLM(model=str(tiny_verifier), max_model_len=512, kv_cache_memory_bytes=2**20,
            enforce_eager=True, dtype="float32",
            speculative_config={"model": "vllm_specdiff.SpecDiffProposer",
                                "num_speculative_tokens": 1000},
            additional_config={"specdiff": {"drafter": str(tiny_drafter)}})


@pytest.mark.vllm
def test_other_verifier_without_drafter_fails_engine_start(tiny_verifier, monkeypatch):
    from vllm import LLM

    from vllm_specdiff import models

    monkeypatch.delenv(models.DRAFTER_ENV, raising=False)
    with pytest.raises(Exception, match="'drafter'\\] is required when serving"):
        LLM(model=str(tiny_verifier), max_model_len=128, kv_cache_memory_bytes=2**20,
            enforce_eager=True, dtype="float32",
            speculative_config={"model": "vllm_specdiff.SpecDiffProposer",
                                "num_speculative_tokens": 2})
