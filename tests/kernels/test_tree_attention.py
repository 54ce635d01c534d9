"""Tree-mask attention: torch reference vs dense SDPA, Triton (interpreted) vs the reference."""

import math

import pytest
import torch

from vllm_specdiff.core.backends import select_backend
from vllm_specdiff.core.tree import build_token_tree
from vllm_specdiff_kernels import dispatch
from vllm_specdiff_kernels.tree_attention_ref import tree_attention_torch
from vllm_specdiff_kernels.tree_attention_triton import tree_attention_triton
from vllm_specdiff_kernels.tree_mask import tree_mask_from_parents

# Triton's interpreter converts arrays to index scalars the way NumPy >= 1.25 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

BLOCK_SIZE = 16
TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def make_case(prefix_lens, num_drafts=3, gamma=4, heads=2, kv_heads=1, head_dim=64,
              dtype=torch.float32, tree_in_cache=False, seed=0, block_size=BLOCK_SIZE,
              heads_major_cache=False):
    """Random paged cache + token tree; physical blocks are shuffled across requests.

    heads_major_cache stores the cache as [blocks, Hkv, block_size, D] and passes a transposed
    view, as a backend with that layout would.
    """
    gen = torch.Generator().manual_seed(seed)
    b = len(prefix_lens)
    drafts = torch.randint(0, 3, (b, num_drafts, gamma), generator=gen)
    tree = build_token_tree(torch.zeros(b, dtype=torch.long), drafts)
    counts = tree.node_counts().tolist()
    need = [-(-(p + n) // block_size) for p, n in zip(prefix_lens, counts, strict=True)]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(need) + 1
    block_tables = torch.zeros(b, max_blocks, dtype=torch.int32)
    used = 0
    for i, k in enumerate(need):
        block_tables[i, :k] = perm[used:used + k]
        used += k
    shape = (num_blocks, kv_heads, block_size, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype).transpose(1, 2)
    value_cache = torch.randn(shape, generator=gen).to(dtype).transpose(1, 2)
    if not heads_major_cache:
        key_cache, value_cache = key_cache.contiguous(), value_cache.contiguous()
    n = tree.num_nodes
    query = torch.randn(n, heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
    if tree_in_cache:  # what vLLM does: write the new tokens through the slot mapping first
        for i, start in enumerate(tree.offsets[:-1].tolist()):
            for local in range(counts[i]):
                pos = prefix_lens[i] + local
                blk, off = int(block_tables[i, pos // block_size]), pos % block_size
                key_cache[blk, off] = key[start + local]
                value_cache[blk, off] = value[start + local]
        key = value = None
    args = (query, key, value, key_cache, value_cache, block_tables,
            torch.tensor(prefix_lens, dtype=torch.int32), tree.offsets.to(torch.int32),
            tree_mask_from_parents(tree.parents, tree.offsets))
    return args, tree


def dense_sdpa(args, tree):
    """Independent oracle: contiguous K/V and the core's dense ancestor mask through SDPA."""
    query, key, value, key_cache, value_cache, block_tables, prefix_lens, offsets, _ = args
    dense_mask = tree.ancestor_mask()
    group = query.shape[1] // key_cache.shape[2]
    block_size = key_cache.shape[1]
    out = torch.empty_like(query, dtype=torch.float32)
    for b in range(len(prefix_lens)):
        start, end = int(offsets[b]), int(offsets[b + 1])
        n, p = end - start, int(prefix_lens[b])
        total = p + (n if key is None else 0)
        slots = [(int(block_tables[b, t // block_size]), t % block_size) for t in range(total)]
        ks = [key_cache[blk, off] for blk, off in slots]
        vs = [value_cache[blk, off] for blk, off in slots]
        if key is not None:
            ks += list(key[start:end])
            vs += list(value[start:end])
        k = torch.stack(ks).float().repeat_interleave(group, 1).transpose(0, 1)
        v = torch.stack(vs).float().repeat_interleave(group, 1).transpose(0, 1)
        mask = torch.cat([torch.ones(n, p, dtype=torch.bool), dense_mask[b, :n, :n]], dim=1)
        q = query[start:end].float().transpose(0, 1)
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask).transpose(0, 1)
    return out


@pytest.mark.parametrize("tree_in_cache", [False, True])
def test_reference_matches_dense_sdpa(tree_in_cache):
    args, tree = make_case([0, 19, 37], heads=4, kv_heads=2, tree_in_cache=tree_in_cache)
    ref = tree_attention_torch(*args)
    torch.testing.assert_close(ref, dense_sdpa(args, tree), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,head_dim,heads,kv_heads,splits,in_cache", [
    (torch.float32, 64, 2, 1, 1, False),
    (torch.float16, 64, 4, 2, 3, True),
    (torch.bfloat16, 128, 2, 2, 1, False),
    (torch.float32, 128, 4, 1, 2, True),
])
def test_triton_matches_reference(dtype, head_dim, heads, kv_heads, splits, in_cache):
    args, _ = make_case([3, 0, 41], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                        dtype=dtype, tree_in_cache=in_cache, seed=7)
    ref = tree_attention_torch(*args)
    out = tree_attention_triton(*args, num_splits=splits)
    assert out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("block_size,heads_major", [(5, False), (32, True)])
def test_any_block_size_and_cache_strides(block_size, heads_major):
    args, tree = make_case([7, 30], heads=4, kv_heads=2, seed=13, block_size=block_size,
                           heads_major_cache=heads_major)
    assert args[3].is_contiguous() != heads_major
    ref = tree_attention_torch(*args)
    torch.testing.assert_close(ref, dense_sdpa(args, tree), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tree_attention_triton(*args, num_splits=2), ref,
                               atol=1e-4, rtol=1e-4)


def test_tree_wider_than_one_mask_word():
    args, _ = make_case([5, 20], num_drafts=1, gamma=39, seed=3)  # chains of 40 nodes
    assert args[-1].shape[1] == 2
    torch.testing.assert_close(tree_attention_triton(*args, num_splits=2),
                               tree_attention_torch(*args), atol=1e-4, rtol=1e-4)


def test_fully_masked_rows_give_zeros_not_nan():
    args, _ = make_case([0, 9], seed=5)
    mask = args[-1].clone()
    offsets = args[7]
    blind = [int(offsets[0]), int(offsets[0]) + 2]  # request 0 has no prefix
    mask[blind] = 0
    args = (*args[:-1], mask)
    for out in (tree_attention_torch(*args), tree_attention_triton(*args)):
        assert torch.isfinite(out).all()
        assert (out[blind] == 0).all()
        assert (out[int(offsets[1]):].abs().sum(dim=-1) > 0).all()
    torch.testing.assert_close(tree_attention_triton(*args), tree_attention_torch(*args),
                               atol=1e-4, rtol=1e-4)


def test_custom_softmax_scale():
    args, _ = make_case([12], seed=9)
    scale = 0.5 / math.sqrt(64)
    ref = tree_attention_torch(*args, softmax_scale=scale)
    assert not torch.allclose(ref, tree_attention_torch(*args), atol=1e-3)
    torch.testing.assert_close(tree_attention_triton(*args, softmax_scale=scale), ref,
                               atol=1e-4, rtol=1e-4)


def test_dispatch_picks_backend_from_env(monkeypatch):
    args, _ = make_case([4, 8], seed=11)
    ref = tree_attention_torch(*args)
    cpu = torch.device("cpu")
    assert select_backend(dispatch.TREE_ATTENTION_KERNEL, cpu) == "torch"  # auto on CPU
    monkeypatch.setenv("SPECDIFF_KERNELS", "triton")
    assert select_backend(dispatch.TREE_ATTENTION_KERNEL, cpu) == "triton"
    torch.testing.assert_close(dispatch.tree_attention(*args), ref, atol=1e-4, rtol=1e-4)
    monkeypatch.setenv("SPECDIFF_KERNELS", "torch")
    assert torch.equal(dispatch.tree_attention(*args), ref)


def test_bad_shapes_are_rejected():
    args, _ = make_case([4], heads=3, kv_heads=1, seed=2)
    bad_heads = (args[0], args[1], args[2],
                 args[3].repeat(1, 1, 2, 1), args[4].repeat(1, 1, 2, 1), *args[5:])
    with pytest.raises(ValueError, match="multiple of KV heads"):
        tree_attention_torch(*bad_heads)
    with pytest.raises(ValueError, match="tree_mask"):
        tree_attention_triton(*args[:-1], args[-1].long())
