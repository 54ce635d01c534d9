"""Pieces of tree verification that need no engine: the KV layout, tree attention, the tree
options and the worker they select."""

from __future__ import annotations

import pytest
import torch

from vllm_specdiff.core.trie import build_request_trie

pytestmark = pytest.mark.vllm


@pytest.fixture(autouse=True)
def _standalone_default_drafter(monkeypatch):
    """These tests are about the tree worker of a drafter that reads token ids: pin the
    standalone default (the conditioned default's worker: test_conditioned_tree_parts.py)."""
    from vllm_specdiff import models

    monkeypatch.setattr(models, "DEFAULT_DRAFTER_KIND", "standalone")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_layout_probe_reads_and_moves_what_the_kernel_wrote(dtype):
    from vllm import _custom_ops as ops

    from vllm_specdiff.plugin.tree_attention import CacheLayout

    heads, bs, dim, blocks = 2, 32, 64, 4
    layout = CacheLayout.probe(heads, bs, dim, dtype, "vec")
    cache = torch.zeros(blocks, heads, bs, 2 * dim, dtype=dtype)
    key_cache, value_cache = cache.view(blocks, heads, 2 * bs, dim).chunk(2, dim=2)
    slots = torch.tensor([0, 33, 70, 95, 127, 5])
    keys = torch.randn(len(slots), heads, dim).to(dtype)
    values = torch.randn(len(slots), heads, dim).to(dtype)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, "vec",
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    got_k, got_v = layout.gather(cache, slots)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    flat_k, flat_v = layout.flat_index(heads, slots)  # what the per-forward plan reads
    assert torch.equal(cache.view(-1)[flat_k], keys)
    assert torch.equal(cache.view(-1)[flat_v], values)
    layout.move(cache, slots[:2], torch.tensor([100, 101]))
    moved_k, moved_v = layout.gather(cache, torch.tensor([100, 101]))
    assert torch.equal(moved_k, keys[:2]) and torch.equal(moved_v, values[:2])


def test_tree_attention_matches_dense_attention_per_path():
    from vllm_specdiff.plugin.tree_attention import tree_attention

    torch.manual_seed(0)
    heads, kv_heads, dim, prefix = 4, 2, 8, 5
    trie = build_request_trie(3, torch.tensor([[1, 2, 3], [1, 4, 5]]), max_nodes=16)
    n = trie.num_nodes
    q = torch.randn(n, heads, dim)
    k = torch.randn(n, kv_heads, dim)
    v = torch.randn(n, kv_heads, dim)
    pk, pv = torch.randn(prefix, kv_heads, dim), torch.randn(prefix, kv_heads, dim)
    out = tree_attention(q, k, v, pk, pv, trie.ancestor_mask(), 0.3)
    for node in range(n):
        chain = [node]
        while int(trie.parents[chain[-1]]) >= 0:
            chain.append(int(trie.parents[chain[-1]]))
        keys = torch.cat([pk, k[chain[::-1]]]).repeat_interleave(2, dim=1)
        vals = torch.cat([pv, v[chain[::-1]]]).repeat_interleave(2, dim=1)
        att = (torch.einsum("hd,khd->hk", q[node], keys) * 0.3).softmax(-1)
        assert torch.allclose(out[node], torch.einsum("hk,khd->hd", att, vals), atol=1e-5)


@pytest.mark.parametrize(("section", "named"), [
    ({"num_drafts": 0}, "'num_drafts'"),
    ({"num_drafts": 2.0}, "'num_drafts'"),
    ({"num_drafts": 2, "candidates": ["argmax"]}, "needs 'sample'"),
    ({"candidates": ["sample", "argmax"]}, "must start with 'argmax'"),
    ({"candidates": "argmax"}, "'candidates'"),
    ({"candidates": ["argmax", "beam"]}, "'candidates'"),
    ({"selection": "best"}, "'selection'"),
    ({"selection": "walk"}, r"must be one of \['tau', 'tree'\], got 'walk'"),
    ({"num_drafts": 2, "max_tree_tokens": 4}, "use >= 5"),
    ({"num_drafts": 2, "max_tree_tokens": 200}, "vLLM's limit"),
])
def test_bad_tree_option_is_named(section, named):
    from vllm_specdiff.plugin.config import parse_specdiff_config

    with pytest.raises(ValueError, match=named):
        parse_specdiff_config({"specdiff": section}, gamma=4)


def test_k_above_one_selects_the_tree_worker():
    from vllm_specdiff.commands.serve import worker_argv
    from vllm_specdiff.plugin.config import parse_specdiff_config
    from vllm_specdiff.plugin.engine import specdiff_engine_args
    from vllm_specdiff.plugin.workers import CPU_TREE_WORKER

    assert "worker_cls" not in specdiff_engine_args(4)  # K = 1: vLLM's own worker and path
    args = specdiff_engine_args(4, num_drafts=3, drafter_temperature=1.5)
    assert args["worker_cls"] == CPU_TREE_WORKER and args["async_scheduling"] is False
    assert "compilation_config" not in args  # CUDA graphs are a CUDA matter
    assert args["additional_config"]["specdiff"]["num_drafts"] == 3
    config = parse_specdiff_config({"specdiff": {"num_drafts": 2}}, gamma=4)
    assert worker_argv(["m"], config) == ["m", "--worker-cls", CPU_TREE_WORKER,
                                               "--no-async-scheduling"]
    assert worker_argv(["m", "--worker-cls", "x.W"], config) == [
        "m", "--worker-cls", "x.W", "--no-async-scheduling"]
    assert worker_argv(["m"], parse_specdiff_config(None)) == ["m"]
