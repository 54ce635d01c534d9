"""Backend choice (the core's), the env override, how the kernels register with the core, and a
package that works where Triton is absent."""

import os
import subprocess
import sys

import pytest
import torch

from vllm_specdiff.core import backends
from vllm_specdiff.core.scoring import STREAK_KERNEL, score_drafts
from vllm_specdiff.core.tree import build_token_tree
from vllm_specdiff_kernels import TREE_ATTENTION_KERNEL

# Triton's interpreter converts arrays to index scalars the way NumPy >= 1.25 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_uses_triton_only_on_cuda(monkeypatch):
    for kernel in (STREAK_KERNEL, TREE_ATTENTION_KERNEL):
        assert backends.select_backend(kernel, CPU) == "torch"
        assert backends.select_backend(kernel, CUDA) == "triton"  # Triton is installed here
    monkeypatch.setenv("SPECDIFF_KERNELS", "torch")
    assert backends.select_backend(STREAK_KERNEL, CUDA) == "torch"
    monkeypatch.setenv("SPECDIFF_KERNELS", " Triton ")
    assert backends.select_backend(STREAK_KERNEL, CPU) == "triton"  # interpreter is on


def test_bad_settings_are_rejected(monkeypatch):
    monkeypatch.setenv("SPECDIFF_KERNELS", "cuda")
    with pytest.raises(ValueError, match="SPECDIFF_KERNELS"):
        backends.select_backend(STREAK_KERNEL, CPU)
    monkeypatch.setenv("SPECDIFF_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        backends.select_backend(STREAK_KERNEL, CPU)


def test_without_triton_everything_falls_back_to_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.setattr(backends, "triton_available", backends.triton_available.__wrapped__)
    assert not backends.triton_available()
    assert backends.select_backend(STREAK_KERNEL, CUDA) == "torch"
    monkeypatch.setenv("SPECDIFF_KERNELS", "triton")
    with pytest.raises(ValueError, match="not installed"):
        backends.select_backend(STREAK_KERNEL, CUDA)


def test_a_kernel_nobody_registered_stays_on_torch(monkeypatch):
    assert backends.select_backend("no_such_kernel", CUDA) == "torch"
    monkeypatch.setenv("SPECDIFF_KERNELS", "triton")
    with pytest.raises(ValueError, match="no Triton implementation of 'no_such_kernel'"):
        backends.select_backend("no_such_kernel", CUDA)


def test_score_drafts_runs_the_registered_triton_kernel(monkeypatch):
    calls = []
    real = backends._triton_loaders[STREAK_KERNEL]

    def counting_loader():
        impl = real()

        def counted(*args):
            calls.append(len(args))
            return impl(*args)
        return counted

    monkeypatch.setitem(backends._triton_loaders, STREAK_KERNEL, counting_loader)
    tree = build_token_tree(torch.zeros(1, dtype=torch.long), torch.tensor([[[1, 2], [2, 1]]]))
    logits = torch.randn(tree.num_nodes, 7, generator=torch.Generator().manual_seed(0))
    want = score_drafts(logits, tree, 1.0)  # auto on CPU: the core's torch reference
    assert calls == []
    monkeypatch.setenv("SPECDIFF_KERNELS", "triton")
    got = score_drafts(logits, tree, 1.0)
    assert calls == [5]
    torch.testing.assert_close(got.tau, want.tau, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.selected, want.selected)


def _fresh_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """`code` in a new interpreter that cannot see the repo root (-P, run from `/`)."""
    return subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                          timeout=300, check=False, cwd="/", env={**os.environ, **env})


def test_package_import_does_not_import_triton():
    code = ("import sys, vllm_specdiff_kernels, vllm_specdiff_kernels.dispatch; "
            "assert 'triton' not in sys.modules, 'triton imported'")
    result = _fresh_python(code)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_core_scores_on_cpu_without_importing_the_kernels_or_triton():
    code = ("import sys, torch\n"
            "from vllm_specdiff.core.scoring import score_drafts\n"
            "from vllm_specdiff.core.tree import build_token_tree\n"
            "tree = build_token_tree(torch.zeros(1, dtype=torch.long), torch.tensor([[[1, 2]]]))\n"
            "score_drafts(torch.randn(tree.num_nodes, 5), tree, 1.0)\n"
            "print(sorted(m for m in sys.modules\n"
            "             if m.startswith('vllm_specdiff_kernels') or m == 'triton'))\n")
    result = _fresh_python(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_a_fresh_process_finds_the_kernels_through_the_entry_point():
    """Nobody imports the kernels package: the core loads it through its entry-point group."""
    code = ("import torch\n"
            "from vllm_specdiff.core import backends\n"
            "from vllm_specdiff.core.scoring import STREAK_KERNEL\n"
            "impl = backends.implementation(STREAK_KERNEL, torch.device('cpu'), None)\n"
            "print(impl.__module__)\n")
    result = _fresh_python(code, SPECDIFF_KERNELS="triton", TRITON_INTERPRET="1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "vllm_specdiff_kernels.draft_logprobs_triton"
