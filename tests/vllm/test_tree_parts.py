"""Pieces of tree verification that need no engine: the trie, the KV layout, tree attention."""

from __future__ import annotations

import pytest
import torch

from vllm_specdiff.core.trie import build_request_trie

pytestmark = pytest.mark.vllm


def test_trie_puts_candidate_zero_first_and_truncates_to_a_trie():
    drafts = torch.tensor([[5, 6, 7], [5, 8, 9], [4, 6, 7]])
    trie = build_request_trie(1, drafts, max_nodes=16)
    assert trie.draft_nodes[0].tolist() == [1, 2, 3]
    assert trie.tokens.tolist()[:4] == [1, 5, 6, 7]
    assert trie.num_nodes == 1 + 3 + 2 + 3  # shared "5" prefix merged
    # every parent comes before its child, and depth = parent's depth + 1
    for node in range(1, trie.num_nodes):
        parent = int(trie.parents[node])
        assert 0 <= parent < node
        assert int(trie.depths[node]) == int(trie.depths[parent]) + 1
    for k in range(3):
        assert trie.tokens[trie.draft_nodes[k]].tolist() == drafts[k].tolist()
    assert trie.is_chain(4) and not trie.is_chain(5)
    # nodes after the chain go by depth: 4, 8, 6 (depth 1-2) then 9, 7 (depth 3)
    assert trie.truncated(6).num_drafts == 1
    cut = trie.truncated(8)
    assert cut.num_drafts == 2 and int(cut.draft_nodes.max()) < 8
    assert cut.tokens[cut.draft_nodes[1]].tolist() == [5, 8, 9]


def test_trie_drops_trailing_candidates_over_the_budget():
    drafts = torch.tensor([[1, 2], [3, 4], [5, 6]])
    trie = build_request_trie(0, drafts, max_nodes=5)
    assert trie.num_drafts == 2 and trie.num_nodes == 5
    with pytest.raises(ValueError, match="cannot hold one draft"):
        build_request_trie(0, drafts, max_nodes=2)


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
    from vllm_specdiff.commands.serve import tree_worker_argv
    from vllm_specdiff.plugin.config import CPU_TREE_WORKER, parse_specdiff_config
    from vllm_specdiff.plugin.engine import specdiff_engine_args

    assert "worker_cls" not in specdiff_engine_args(4)  # K = 1: vLLM's own worker and path
    args = specdiff_engine_args(4, num_drafts=3, drafter_temperature=1.5)
    assert args["worker_cls"] == CPU_TREE_WORKER and args["async_scheduling"] is False
    assert "compilation_config" not in args  # CUDA graphs are a CUDA matter
    assert args["additional_config"]["specdiff"]["num_drafts"] == 3
    config = parse_specdiff_config({"specdiff": {"num_drafts": 2}}, gamma=4)
    assert tree_worker_argv(["m"], config) == ["m", "--worker-cls", CPU_TREE_WORKER,
                                               "--no-async-scheduling"]
    assert tree_worker_argv(["m", "--worker-cls", "x.W"], config) == [
        "m", "--worker-cls", "x.W", "--no-async-scheduling"]
    assert tree_worker_argv(["m"], parse_specdiff_config(None)) == ["m"]


def test_k_above_one_without_the_tree_worker_fails_at_load(tiny_verifier, tiny_drafter):
    from vllm import LLM

    from tests.vllm.tiny_models import speculative_args

    with pytest.raises(Exception, match="--worker-cls"):
        LLM(model=str(tiny_verifier), max_model_len=128, kv_cache_memory_bytes=200_000,
            dtype="float32", enforce_eager=True,
            **speculative_args(tiny_drafter, gamma=4, num_drafts=2, adaptive=False))


def test_ngram_candidate_continues_the_earlier_match():
    import numpy as np

    from vllm_specdiff.core.candidates import ngram_draft

    fill = torch.tensor([9, 9, 9])
    context = np.array([1, 2, 3, 4, 5, 1, 2, 3])
    assert ngram_draft(context, 3, fill).tolist() == [4, 5, 1]
    assert ngram_draft(np.array([7, 8, 1, 2, 3, 4, 1, 2]), 3, fill).tolist() == [3, 4, 1]
    assert ngram_draft(np.array([1, 2, 3, 4]), 3, fill) is None


def test_ngram_candidate_matches_vllms_own_prompt_lookup():
    """Same matches as vLLM's numba function (in a subprocess: importing numba breaks vLLM's
    kernel registration for later engines in this process)."""
    import subprocess
    import sys

    code = """
import numpy as np, torch
from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens
from vllm_specdiff.core.candidates import NGRAM_MAX, NGRAM_MIN, ngram_draft
rng = np.random.default_rng(0)
found = 0
for trial in range(300):
    ctx = rng.integers(0, 4, size=int(rng.integers(3, 40)))
    ref = _find_longest_matched_ngram_and_propose_tokens(ctx.astype(np.int32), NGRAM_MIN,
                                                         NGRAM_MAX, len(ctx) + 4, 4)
    ours = ngram_draft(ctx, 4, torch.full((4,), -1))
    if len(ref) == 0:
        assert ours is None, (ctx, ours)
        continue
    found += 1
    assert ours[: len(ref)].tolist() == list(ref), (ctx, ref, ours)
print(found)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.strip().splitlines()[-1]) > 100


def test_trie_keeps_each_candidates_source_through_truncation():
    drafts = torch.tensor([[5, 6, 7], [5, 8, 9], [4, 6, 7]])
    trie = build_request_trie(1, drafts, 16, ("argmax", "ngram", "sample"))
    assert trie.sources == ("argmax", "ngram", "sample")
    assert trie.truncated(8).sources == ("argmax", "ngram")
    assert build_request_trie(1, drafts, 6, ("argmax", "ngram", "sample")).sources == \
        ("argmax", "ngram")
