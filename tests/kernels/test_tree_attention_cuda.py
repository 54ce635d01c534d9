"""The CUDA tree-attention wrapper (`plugin.tree_attention_cuda`) on vLLM's CUDA cache layout:
its trie rows equal dense attention over prefix + ancestors, through the dispatch's torch
reference and through the Triton kernel (interpreted), and the other rows are left alone."""

import pytest
import torch

from vllm_specdiff.core import backends
from vllm_specdiff_benchmarks.kernels import (
    Row,
    check_tree_wrapper,
    check_wrapper_rows,
    run_wrapper,
    wrapper_case,
)
from vllm_specdiff_kernels import TREE_ATTENTION_KERNEL

# Triton's interpreter converts arrays to index scalars the way NumPy >= 1.25 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

SCALE = 0.25
CPU = torch.device("cpu")


def dense_path_attention(case, req_index: int, node: int) -> torch.Tensor:
    """[H, D] attention of one trie node over its prefix and its ancestors, from plain tensors."""
    req, parents = case.requests[req_index], case.parents[req_index]
    chain = [node]
    while int(parents[chain[-1]]) >= 0:
        chain.append(int(parents[chain[-1]]))
    rows = [req.query_start + i for i in chain[::-1]]
    group = case.query.shape[1] // case.key.shape[1]
    keys = torch.cat([case.prefix_keys[req_index], case.key[rows]]).float()
    values = torch.cat([case.prefix_values[req_index], case.value[rows]]).float()
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    q = case.query[req.query_start + node].float()
    weights = (torch.einsum("hd,khd->hk", q, keys) * SCALE).softmax(-1)
    return torch.einsum("hk,khd->hd", weights, values)


def assert_trie_rows_match_dense(case, out: torch.Tensor) -> None:
    """Every trie node's output row equals dense attention over its prefix and ancestors."""
    for i, req in enumerate(case.requests):
        for node in range(req.num_nodes):
            torch.testing.assert_close(out[req.query_start + node],
                                       dense_path_attention(case, i, node),
                                       atol=1e-4, rtol=1e-4)


def _count_triton_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = backends._triton_loaders[TREE_ATTENTION_KERNEL]

    def counting_loader():
        impl = real()

        def counted(*args, **kwargs):
            calls.append(args[0].shape[0])
            return impl(*args, **kwargs)
        return counted

    monkeypatch.setitem(backends._triton_loaders, TREE_ATTENTION_KERNEL, counting_loader)
    return calls


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("tokens_major", [True, False])
def test_cuda_wrapper_rows_equal_dense_attention_per_path(monkeypatch, backend, tokens_major):
    monkeypatch.setenv("SPECDIFF_KERNELS", backend)
    calls = _count_triton_calls(monkeypatch)
    assert backends.select_backend(TREE_ATTENTION_KERNEL, CPU) == backend
    case = wrapper_case(torch.float32, CPU, tokens_major=tokens_major)
    assert case.kv_cache.is_contiguous() != tokens_major  # the physical layout under test
    out = run_wrapper(case, SCALE)
    nodes = sum(r.num_nodes for r in case.requests)
    assert calls == ([nodes] if backend == "triton" else [])  # one call for all trie requests
    assert torch.equal(out[:5], torch.zeros_like(out[:5]))  # the chain request: native rows
    assert_trie_rows_match_dense(case, out)


def test_cuda_wrapper_packs_tries_of_different_mask_widths(monkeypatch):
    """A trie wider than one 32-bit mask word next to a small one (masks padded to one width),
    GQA 8/2, head dim 64, block size 32, through the Triton kernel."""
    monkeypatch.setenv("SPECDIFF_KERNELS", "triton")
    case = wrapper_case(torch.float32, CPU, prefix_lens=(3, 70), heads=8, head_dim=64,
                        block_size=32, draft_shapes=((12, 6), (2, 3)), seed=1)
    assert case.requests[0].num_nodes > 32 >= case.requests[1].num_nodes
    out = run_wrapper(case, SCALE)
    assert_trie_rows_match_dense(case, out)


def test_cuda_wrapper_in_bfloat16_through_triton_matches_the_torch_reference(monkeypatch):
    monkeypatch.setenv("SPECDIFF_KERNELS", "triton")
    rows = check_tree_wrapper(torch.bfloat16, CPU, 1)
    assert [r.impl for r in rows] == ["triton via dispatch (CPU interpreter)"] * 2
    assert all(r.max_diff < 3e-2 for r in rows)


def test_the_gpu_check_catches_a_wrapper_that_ignores_the_tree(monkeypatch):
    """Negative control for the lent-GPU check: a wrapper that leaves the rows alone fails."""
    from vllm_specdiff.plugin import tree_attention_cuda

    monkeypatch.setattr(tree_attention_cuda.CudaTreeMaskForward, "recompute",
                        lambda self, *args: None)
    with pytest.raises(RuntimeError, match="wrong rows"):
        check_tree_wrapper(torch.float32, CPU, 1)


def test_the_gpu_check_fails_beyond_the_dtype_tolerance():
    row = Row("tree wrapper (vLLM CUDA layout)", "B=2", "triton via dispatch", 1.0, 1, 2e-4)
    check_wrapper_rows([row], torch.bfloat16)
    with pytest.raises(RuntimeError, match="beyond 1e-04"):
        check_wrapper_rows([row], torch.float32)
    row.max_diff = float("nan")
    with pytest.raises(RuntimeError, match="nan"):
        check_wrapper_rows([row], torch.bfloat16)
