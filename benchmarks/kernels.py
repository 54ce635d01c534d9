"""Time the self-selection kernels against their plain-torch alternatives.

    python -m vllm_specdiff_benchmarks.kernels [--device cuda|cpu] [--peak-gbps 4800]
        [--output table.md] [--json rows.json]

On CUDA it times, per shape:
  tree attention   Triton kernel (paged prefix + bitmask) vs torch SDPA with a dense boolean
                   mask over pre-gathered, contiguous K/V (the gather is NOT timed, which favours
                   SDPA);
  draft log-probs  fused Triton kernel vs the unfused torch path (log-softmax + gather + cumsum,
                   `vllm_specdiff.core.scoring.draft_logprob_streak_torch`).
Achieved bandwidth = compulsory bytes / median time, where compulsory bytes count every input
read once and every output written once (for the log-probs: each distinct parent row of the
logits). "% peak" compares it with --peak-gbps (default 4800, an H200's HBM3e).

On CPU only the torch paths run (Triton compiles for GPUs; vLLM's CPU build has no Triton), on
smaller shapes, labelled as CPU rows: a smoke test that the script and references work, not a
performance figure. With SPECDIFF_KERNELS=triton TRITON_INTERPRET=1 the Triton rows run too,
in Triton's interpreter (their times mean nothing; it checks the code path). Every row also
reports the max |difference| from the torch reference.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from vllm_specdiff.core.backends import ENV_VAR, select_backend
from vllm_specdiff.core.scoring import STREAK_KERNEL, draft_logprob_streak_torch
from vllm_specdiff.core.tree import TokenTree, build_token_tree
from vllm_specdiff.core.trie import build_request_trie
from vllm_specdiff.plugin.tree_attention import TreeBatchContext, TreeRequest
from vllm_specdiff.plugin.tree_attention_cuda import CudaTreeMaskForward, PagedKVLayout
from vllm_specdiff.provenance import provenance
from vllm_specdiff_benchmarks import emit_report, invocation
from vllm_specdiff_kernels.dispatch import TREE_ATTENTION_KERNEL
from vllm_specdiff_kernels.tree_attention_ref import tree_attention_torch
from vllm_specdiff_kernels.tree_mask import tree_mask_from_parents

MODULE = "vllm_specdiff_benchmarks.kernels"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class AttentionShape:
    requests: int
    prefix: int
    drafts: int
    gamma: int
    heads: int
    kv_heads: int
    head_dim: int

    def label(self) -> str:
        return (f"B={self.requests} prefix={self.prefix} K={self.drafts} G={self.gamma} "
                f"H={self.heads}/{self.kv_heads} D={self.head_dim}")


@dataclass(frozen=True)
class LogprobShape:
    requests: int
    drafts: int
    gamma: int
    vocab: int

    def label(self) -> str:
        return f"B={self.requests} K={self.drafts} G={self.gamma} V={self.vocab}"


GPU_ATTENTION = [
    AttentionShape(1, 4096, 8, 16, 32, 8, 128),
    AttentionShape(8, 2048, 4, 8, 32, 8, 128),
    AttentionShape(32, 1024, 4, 8, 64, 8, 128),
    AttentionShape(16, 1024, 8, 16, 32, 32, 64),
]
GPU_LOGPROBS = [
    LogprobShape(1, 8, 16, 152_064),
    LogprobShape(8, 4, 8, 128_256),
    LogprobShape(32, 4, 8, 256_000),
]
CPU_ATTENTION = [AttentionShape(2, 256, 4, 8, 8, 2, 64)]
CPU_LOGPROBS = [LogprobShape(2, 4, 8, 32_000)]


@dataclass
class Row:
    kernel: str
    shape: str
    impl: str
    seconds: float
    nbytes: int
    max_diff: float


def random_tree(requests: int, drafts: int, gamma: int, vocab: int, device: torch.device,
                seed: int) -> TokenTree:
    """Drafts over a tiny alphabet so that they share prefixes like real ones do."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, min(vocab, 4), (requests, drafts, gamma), generator=gen)
    tree = build_token_tree(torch.zeros(requests, dtype=torch.long), tokens)
    return TokenTree(*(t.to(device) for t in (tree.tokens, tree.parents, tree.depths,
                                              tree.offsets, tree.draft_nodes, tree.drafts)))


def time_it(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds per call (triton.testing.do_bench on CUDA, which flushes the L2)."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=max(repeats, 20),
                                       return_mode="median") / 1e3
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_attention(shape: AttentionShape, dtype: torch.dtype, device: torch.device,
                    repeats: int) -> list[Row]:
    tree = random_tree(shape.requests, shape.drafts, shape.gamma, 50, device, seed=0)
    n, b, block = tree.num_nodes, shape.requests, 16
    counts = tree.node_counts()
    gen = torch.Generator(device=device).manual_seed(0)
    blocks_per_req = -(-shape.prefix // block)
    num_blocks = b * blocks_per_req
    cache_shape = (num_blocks, block, shape.kv_heads, shape.head_dim)
    key_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
    value_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
    block_tables = torch.randperm(num_blocks, generator=gen, device=device).view(b, -1).int()
    prefix_lens = torch.full((b,), shape.prefix, dtype=torch.int32, device=device)
    q = torch.randn(n, shape.heads, shape.head_dim, generator=gen, device=device, dtype=dtype)
    k = torch.randn(n, shape.kv_heads, shape.head_dim, generator=gen, device=device, dtype=dtype)
    v = torch.randn_like(k)
    cu = tree.offsets.int()
    mask = tree_mask_from_parents(tree.parents, tree.offsets)
    args = (q, k, v, key_cache, value_cache, block_tables, prefix_lens, cu, mask)
    max_nodes = int(counts.max())
    reference = tree_attention_torch(*args)

    # Dense SDPA baseline: contiguous [B, H, L, D] K/V padded to the longest request.
    group = shape.heads // shape.kv_heads
    length = shape.prefix + max_nodes
    dense_k = torch.zeros(b, length, shape.kv_heads, shape.head_dim, device=device, dtype=dtype)
    dense_v = torch.zeros_like(dense_k)
    dense_q = torch.zeros(b, max_nodes, shape.heads, shape.head_dim, device=device, dtype=dtype)
    dense_mask = torch.zeros(b, 1, max_nodes, length, dtype=torch.bool, device=device)
    ancestors = tree.ancestor_mask()
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        nodes = end - start
        flat = block_tables[i].long()
        dense_k[i, :shape.prefix] = key_cache[flat].flatten(0, 1)[:shape.prefix]
        dense_v[i, :shape.prefix] = value_cache[flat].flatten(0, 1)[:shape.prefix]
        dense_k[i, shape.prefix:shape.prefix + nodes] = k[start:end]
        dense_v[i, shape.prefix:shape.prefix + nodes] = v[start:end]
        dense_q[i, :nodes] = q[start:end]
        dense_mask[i, 0, :nodes, :shape.prefix] = True
        dense_mask[i, 0, :nodes, shape.prefix:] = ancestors[i, :nodes, :max_nodes]
        dense_mask[i, 0, nodes:, 0] = True  # padding rows: anything finite
    sdpa_q = dense_q.transpose(1, 2)
    sdpa_k = dense_k.repeat_interleave(group, dim=2).transpose(1, 2)
    sdpa_v = dense_v.repeat_interleave(group, dim=2).transpose(1, 2)

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(sdpa_q, sdpa_k, sdpa_v,
                                                                attn_mask=dense_mask)

    def sdpa_diff() -> float:
        out = sdpa().transpose(1, 2)
        got = torch.cat([out[i, :int(c)] for i, c in enumerate(counts.tolist())])
        return (got.float() - reference.float()).abs().max().item()

    es = torch.tensor([], dtype=dtype).element_size()
    nbytes = (2 * n * shape.heads * shape.head_dim * es  # q, out
              + 2 * (b * shape.prefix + n) * shape.kv_heads * shape.head_dim * es  # K, V
              + mask.numel() * 4 + block_tables.numel() * 4)
    label = shape.label()
    rows = [Row("tree attention", label, "SDPA dense mask" + _where(device, triton=False),
                time_it(sdpa, device, repeats), nbytes, sdpa_diff())]
    if select_backend(TREE_ATTENTION_KERNEL, device) == "triton":
        from vllm_specdiff_kernels.tree_attention_triton import tree_attention_triton

        def fused() -> torch.Tensor:
            return tree_attention_triton(*args, max_tree_nodes=max_nodes,
                                         max_prefix_len=shape.prefix)

        diff = (fused().float() - reference.float()).abs().max().item()
        rows.append(Row("tree attention", label, "Triton paged" + _where(device, triton=True),
                        time_it(fused, device, repeats), nbytes, diff))
    else:
        rows.append(Row("tree attention", label, "torch reference" + _where(device, triton=False),
                        time_it(lambda: tree_attention_torch(*args), device, repeats), nbytes,
                        0.0))
    return rows


def bench_logprobs(shape: LogprobShape, dtype: torch.dtype, device: torch.device,
                   repeats: int) -> list[Row]:
    tree = random_tree(shape.requests, shape.drafts, shape.gamma, shape.vocab, device, seed=1)
    gen = torch.Generator(device=device).manual_seed(1)
    logits = torch.randn(tree.num_nodes, shape.vocab, generator=gen, device=device).to(dtype)
    temp = torch.ones(tree.num_nodes, device=device)
    args = (logits, temp, tree.tokens, tree.parents, tree.draft_nodes)
    reference = draft_logprob_streak_torch(*args)
    parent_rows = torch.unique(tree.parents[tree.parents >= 0]).numel()
    nbytes = parent_rows * shape.vocab * logits.element_size()
    label = shape.label()
    rows = [Row("draft log-probs", label, "unfused torch" + _where(device, triton=False),
                time_it(lambda: draft_logprob_streak_torch(*args), device, repeats), nbytes,
                0.0)]
    if select_backend(STREAK_KERNEL, device) == "triton":
        from vllm_specdiff_kernels.draft_logprobs_triton import draft_logprob_streak_triton

        got = draft_logprob_streak_triton(*args)
        finite = torch.isfinite(reference[0])
        diff = (got[0][finite] - reference[0][finite]).abs().max().item()
        rows.append(Row("draft log-probs", label, "Triton fused" + _where(device, triton=True),
                        time_it(lambda: draft_logprob_streak_triton(*args), device, repeats),
                        nbytes, diff))
    return rows


@dataclass(frozen=True)
class WrapperCase:
    """One layer's inputs as vLLM's CUDA attention backends see them: the logical cache
    [blocks, Hkv, block_size, 2 * D] (tokens-major LBNHC or heads-major LBHNC strides) holding
    every token's K/V at its slot, query/key/value of all scheduled tokens, the block table, and
    the trie requests (request 0 is a plain chain between them). prefix_keys/values and parents
    are the plain tensors an independent reference needs."""

    layout: PagedKVLayout
    kv_cache: torch.Tensor
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    block_table: torch.Tensor
    requests: list[TreeRequest]
    parents: list[torch.Tensor]
    prefix_keys: list[torch.Tensor]
    prefix_values: list[torch.Tensor]


def wrapper_case(dtype: torch.dtype, device: torch.device, tokens_major: bool = True,
                 prefix_lens: tuple[int, ...] = (37, 5), heads: int = 4, kv_heads: int = 2,
                 head_dim: int = 32, block_size: int = 16, seed: int = 0,
                 draft_shapes: tuple[tuple[int, int], ...] | None = None) -> WrapperCase:
    """A random batch: a chain request (prefix 20, 5 tokens), then one trie request per prefix
    length (by default K = 3 drafts of 4 tokens; `draft_shapes` gives (K, gamma) per request;
    over a 3-token alphabet, so they share prefixes)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = draft_shapes or ((3, 4),) * len(prefix_lens)
    tries = [build_request_trie(1, torch.randint(0, 3, shape, generator=gen), 128)
             for shape in shapes]
    prefixes = [20, *prefix_lens]
    counts = [5, *(t.num_nodes for t in tries)]
    need = [-(-(p + n) // block_size) for p, n in zip(prefixes, counts, strict=True)]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(len(need), max(need) + 1, dtype=torch.int32)
    used = 0
    for i, k in enumerate(need):
        block_table[i, :k] = perm[used:used + k]
        used += k
    physical = (num_blocks, block_size, kv_heads, 2 * head_dim) if tokens_major else \
        (num_blocks, kv_heads, block_size, 2 * head_dim)
    kv_cache = torch.zeros(physical, dtype=dtype)
    if tokens_major:
        kv_cache = kv_cache.permute(0, 2, 1, 3)  # logical [blocks, Hkv, block_size, 2D]
    total = sum(counts)
    query = torch.randn(total, heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    requests, prefix_keys, prefix_values = [], [], []
    start = 0
    for i, (p, n) in enumerate(zip(prefixes, counts, strict=True)):
        pk = torch.randn(p, kv_heads, head_dim, generator=gen).to(dtype)
        pv = torch.randn(p, kv_heads, head_dim, generator=gen).to(dtype)
        ks, vs = torch.cat([pk, key[start:start + n]]), torch.cat([pv, value[start:start + n]])
        for pos in range(p + n):  # what the backend's reshape_and_cache writes
            blk, off = int(block_table[i, pos // block_size]), pos % block_size
            kv_cache[blk, :, off, :head_dim] = ks[pos]
            kv_cache[blk, :, off, head_dim:] = vs[pos]
        if i > 0:
            trie = tries[i - 1]
            requests.append(TreeRequest(start, n, p, i, trie.ancestor_mask().to(device)))
            prefix_keys.append(pk.to(device))
            prefix_values.append(pv.to(device))
        start += n
    return WrapperCase(PagedKVLayout(block_size, head_dim), kv_cache.to(device),
                       query.to(device), key.to(device), value.to(device),
                       block_table.to(device), requests, [t.parents for t in tries],
                       prefix_keys, prefix_values)


def run_wrapper(case: WrapperCase, scale: float = 0.25) -> torch.Tensor:
    """The CUDA tree wrapper over a no-op native kernel (output starts at zero)."""
    context = TreeBatchContext()
    context.set(case.requests)
    impl = SimpleNamespace(forward=lambda *args, **kwargs: None, scale=scale)
    forward = CudaTreeMaskForward(impl, case.layout, context)
    output = torch.zeros_like(case.query)
    forward(None, case.query, case.key, case.value, case.kv_cache,
            SimpleNamespace(block_table=case.block_table), output=output)
    return output


@contextlib.contextmanager
def kernel_backend(choice: str) -> Iterator[None]:
    """SPECDIFF_KERNELS=choice for the duration (the dispatch reads it at every call)."""
    saved = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = choice
    try:
        yield
    finally:
        if saved is None:
            del os.environ[ENV_VAR]
        else:
            os.environ[ENV_VAR] = saved


def check_layout_moves(case: WrapperCase) -> None:
    """gather/move through `PagedKVLayout` equal plain indexing of the logical cache."""
    req = case.requests[0]
    rows = torch.arange(req.query_start, req.query_start + req.num_nodes, device=case.key.device)
    table = case.block_table[req.batch_index].long()
    pos = req.prefix_len + torch.arange(req.num_nodes, device=rows.device)
    slots = table[pos // case.layout.block_size] * case.layout.block_size \
        + pos % case.layout.block_size
    keys, values = case.layout.gather(case.kv_cache, slots)
    if not (torch.equal(keys, case.key[rows]) and torch.equal(values, case.value[rows])):
        raise RuntimeError("PagedKVLayout.gather does not read what the backend wrote")
    cache = case.kv_cache.clone()  # keeps the strides
    case.layout.move(cache, slots[1:3], slots[:2])
    moved_k, moved_v = case.layout.gather(cache, slots[:2])
    kept_k, _ = case.layout.gather(cache, slots[2:])
    if not (torch.equal(moved_k, keys[1:3]) and torch.equal(moved_v, values[1:3])
            and torch.equal(kept_k, keys[2:])):
        raise RuntimeError("PagedKVLayout.move did not copy the entries between slots")


def check_tree_wrapper(dtype: torch.dtype, device: torch.device, repeats: int) -> list[Row]:
    """The CUDA path of self-selection (`plugin.tree_attention_cuda`) on both cache layouts:
    the wrapper through the dispatch (Triton on CUDA) vs the same wrapper on the torch
    reference; gather/move must equal plain indexing exactly (else RuntimeError)."""
    rows = []
    backend = select_backend(TREE_ATTENTION_KERNEL, device)
    for tokens_major in (True, False):
        case = wrapper_case(dtype, device, tokens_major=tokens_major)
        check_layout_moves(case)
        got = run_wrapper(case)
        with kernel_backend("torch"):
            want = run_wrapper(case)
        nodes = sum(r.num_nodes for r in case.requests)
        if not torch.isfinite(got).all() or not bool(got[:5].eq(0).all()) or \
                bool(got[case.requests[0].query_start:].eq(0).all()):
            raise RuntimeError("the tree wrapper wrote the wrong rows")
        es = case.query.element_size()
        nbytes = (2 * nodes * case.query[0].numel() + case.kv_cache.numel()) * es
        layout = "LBNHC" if tokens_major else "LBHNC"
        rows.append(Row("tree wrapper (vLLM CUDA layout)",
                        f"B={len(case.requests)} nodes={nodes} {layout}",
                        f"{backend} via dispatch" + _where(device, triton=backend == "triton"),
                        time_it(lambda case=case: run_wrapper(case), device, repeats), nbytes,
                        (got.float() - want.float()).abs().max().item()))
    return rows


# Max |wrapper - torch reference| allowed per dtype (the kernel tests' tolerances).
WRAPPER_TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def check_wrapper_rows(rows: list[Row], dtype: torch.dtype) -> None:
    """Fail the run (after the table is written) when the tree wrapper's rows differ from the
    torch reference by more than the dtype's tolerance: on a GPU this is the CUDA path's check."""
    bad = [f"{r.shape}: {r.max_diff:.2e}" for r in rows
           if r.kernel.startswith("tree wrapper") and not r.max_diff <= WRAPPER_TOLERANCE[dtype]]
    if bad:
        raise RuntimeError(f"tree wrapper differs from the torch reference beyond "
                           f"{WRAPPER_TOLERANCE[dtype]:.0e} ({dtype}): {'; '.join(bad)}")


def _where(device: torch.device, triton: bool) -> str:
    """Label rows that are not GPU measurements."""
    if device.type == "cuda":
        return ""
    return " (CPU interpreter)" if triton else " (CPU)"


def row_record(row: Row, peak_gbps: float | None) -> dict[str, object]:
    """One row as the JSON report holds it (the table's columns, unrounded)."""
    gbps = row.nbytes / row.seconds / 1e9
    return {**dataclasses.asdict(row), "microseconds": row.seconds * 1e6, "gbps": gbps,
            "percent_of_peak": 100 * gbps / peak_gbps if peak_gbps else None}


def format_table(rows: list[Row], peak_gbps: float | None, header: str) -> str:
    lines = [header, "",
             "| kernel | shape | implementation | time (us) | GB/s | % peak | max abs diff |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        gbps = r.nbytes / r.seconds / 1e9
        peak = f"{100 * gbps / peak_gbps:.1f}" if peak_gbps else "-"
        lines.append(f"| {r.kernel} | {r.shape} | {r.impl} | {r.seconds * 1e6:.1f} | "
                     f"{gbps:.1f} | {peak} | {r.max_diff:.2e} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda (Triton vs torch) or cpu (torch paths only, small shapes)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES),
                        help="activation / KV-cache / logits dtype")
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="peak memory bandwidth in GB/s for the %% column (default 4800 on "
                             "CUDA = H200 HBM3e; none on CPU)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per measurement")
    parser.add_argument("--output", default=None, help="also write the Markdown table here")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write every row (with GB/s) and the run's provenance here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    dtype = DTYPES[args.dtype]
    peak = args.peak_gbps if args.peak_gbps is not None else (
        4800.0 if device.type == "cuda" else None)
    on_gpu = device.type == "cuda"
    torch.manual_seed(0)
    rows: list[Row] = []
    for shape in GPU_ATTENTION if on_gpu else CPU_ATTENTION:
        rows += bench_attention(shape, dtype, device, args.repeats)
    for shape in GPU_LOGPROBS if on_gpu else CPU_LOGPROBS:
        rows += bench_logprobs(shape, dtype, device, args.repeats)
    rows += check_tree_wrapper(dtype, device, args.repeats)
    name = torch.cuda.get_device_name(device) if on_gpu else (
        "CPU (Triton interpreted)" if select_backend(STREAK_KERNEL, device) == "triton" else
        "CPU (torch paths only)")
    header = (f"Kernel benchmark, {time.strftime('%Y-%m-%d', time.gmtime())}, {name}, "
              f"{str(dtype).removeprefix('torch.')}, peak {peak or '-'} GB/s")
    table = format_table(rows, peak, header)
    print(table)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(table)
    if args.json:
        emit_report({"provenance": provenance(invocation(MODULE, argv)),
                     "device": name, "dtype": args.dtype, "peak_gbps": peak,
                     "rows": [row_record(r, peak) for r in rows]}, args.json)
    check_wrapper_rows(rows, dtype)
    return table


if __name__ == "__main__":
    main()
