"""The guard around the CPU `expand_kernel` fix: the probe, binding by the kernel's parameter
names, no install when vLLM's fallback works, and a warning (never a crash) when vLLM's private
layout has changed. No engine is started here."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch

from vllm_specdiff.plugin.patches import cpu_fixes
from vllm_specdiff.plugin.patches.cpu_fixes import (
    KERNEL,
    KERNEL_PARAMS,
    expand_any_dtype,
    expand_is_broken,
    fix_cpu_expand_kernel,
    kernel_params,
)

pytestmark = pytest.mark.vllm


def _vllm_fallback():
    """vLLM's own C++ wrapper (its ops loaded), whether or not the fix has replaced it."""
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils

    current_platform.import_kernels()
    return cpu_fixes._replaced.get(KERNEL, cpu_triton_utils._expand_kernel_impl)


@pytest.fixture
def warnings_seen(caplog):
    """Warnings of the fix's logger ("vllm.specdiff" does not propagate to the root logger)."""
    logger = logging.getLogger("vllm.specdiff")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger="vllm.specdiff")
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.fixture
def registry(monkeypatch):
    """A private copy of vLLM's kernel registry and of the patched attributes, restored after."""
    from vllm.triton_utils import dispatcher
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample import rejection_sampler

    monkeypatch.setattr(dispatcher, "_registry", dict(dispatcher._registry))
    monkeypatch.setattr(cpu_triton_utils, "_expand_kernel_impl",
                        cpu_triton_utils._expand_kernel_impl)
    monkeypatch.setattr(rejection_sampler, "expand_kernel", rejection_sampler.expand_kernel)
    monkeypatch.setattr(rejection_sampler._expand, "kernel", rejection_sampler._expand.kernel)
    monkeypatch.setattr(cpu_fixes, "_replaced", dict(cpu_fixes._replaced))
    return dispatcher._registry


def test_probe_finds_vllm_fallback_broken_and_the_replacement_correct():
    out = torch.full((3,), float("nan"))
    _vllm_fallback()(out, torch.tensor([0.5, 2.0]), torch.tensor([2, 3]), 0, 1)  # runs, but
    assert out.isnan().all()  # writes nothing back
    assert expand_is_broken(_vllm_fallback())
    assert not expand_is_broken(expand_any_dtype)


def test_vllm_fallback_also_loses_int32_outputs_which_the_replacement_fills():
    """Per-token top-k is expanded into an int32 tensor: vLLM's wrapper loses it as well (the
    engine then indexes with garbage k), so the replacement must handle every dtype."""
    cu = torch.tensor([2, 3], dtype=torch.int32)
    for impl, expected in ((_vllm_fallback(), [-1, -1, -1]), (expand_any_dtype, [5, 5, 9])):
        out = torch.full((3,), -1, dtype=torch.int32)
        impl(out, torch.tensor([5, 9], dtype=torch.int32), cu, 0, 0)
        assert out.tolist() == expected


def test_probe_counts_an_exception_as_broken():
    def raises(*args):
        raise RuntimeError("no C++ op")

    assert expand_is_broken(raises)


def test_replacement_takes_the_kernels_own_parameter_names():
    """vLLM's dispatcher binds launch arguments by name when the names match the kernel's."""
    from vllm.v1.sample import rejection_sampler

    assert kernel_params(rejection_sampler.expand_kernel) == KERNEL_PARAMS
    assert tuple(inspect.signature(expand_any_dtype).parameters) == KERNEL_PARAMS


def test_fix_installs_when_the_fallback_is_broken(registry):
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    fallback = _vllm_fallback()
    cpu_fixes._replaced.clear()
    cpu_triton_utils._expand_kernel_impl = fallback
    registry[KERNEL] = (rejection_sampler.expand_kernel, fallback)  # as a vLLM worker leaves it
    assert fix_cpu_expand_kernel() is True
    assert registry[KERNEL][1] is expand_any_dtype
    assert cpu_triton_utils._expand_kernel_impl is expand_any_dtype
    temps = expand_batch_to_tokens(torch.tensor([0.7, 0.0]), torch.tensor([3, 4]), 4,
                                   replace_from=0, replace_to=1)
    assert temps.tolist() == pytest.approx([0.7, 0.7, 0.7, 1.0])
    assert fix_cpu_expand_kernel() is False  # idempotent


def test_a_working_fallback_is_left_alone(registry):
    """A vLLM whose own fallback handles float outputs keeps it."""
    from vllm.utils import cpu_triton_utils

    def working(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
        expand_any_dtype(output, input_val, cu_num_tokens, replace_from, replace_to)

    cpu_triton_utils._expand_kernel_impl = working
    registry[KERNEL] = (None, working)
    assert fix_cpu_expand_kernel() is False
    assert cpu_triton_utils._expand_kernel_impl is working
    assert registry[KERNEL][1] is working


def test_changed_kernel_parameters_warn_and_install_nothing(registry, warnings_seen):
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample import rejection_sampler

    def renamed(out_ptr, in_ptr, cu_ptr, replace_from, replace_to, BLOCK):  # noqa: N803
        pass

    rejection_sampler.expand_kernel = renamed
    before = cpu_triton_utils._expand_kernel_impl
    assert fix_cpu_expand_kernel() is False
    assert cpu_triton_utils._expand_kernel_impl is before
    assert "not installed" in warnings_seen.text and "out_ptr" in warnings_seen.text


@pytest.mark.parametrize("missing", ["cpu_triton_utils._expand_kernel_impl",
                                     "rejection_sampler.expand_kernel"])
def test_missing_vllm_internals_warn_instead_of_crashing(registry, warnings_seen, monkeypatch,
                                                         missing):
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample import rejection_sampler

    module, attr = missing.split(".")
    monkeypatch.delattr({"cpu_triton_utils": cpu_triton_utils,
                         "rejection_sampler": rejection_sampler}[module], attr)
    assert fix_cpu_expand_kernel() is False
    assert "AttributeError" in warnings_seen.text and "not installed" in warnings_seen.text
