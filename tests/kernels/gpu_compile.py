"""Compile every Triton kernel for a CUDA target without a GPU (frontend, MLIR passes, ptxas).

The interpreter checks numerics but not that the kernels lower to real GPU code; this does.
Run as a script in a process WITHOUT TRITON_INTERPRET (test_gpu_compile.py does that):
    python tests/kernels/gpu_compile.py [compute capability, default 90]
"""

import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise SystemExit("run without TRITON_INTERPRET: the interpreter replaces @triton.jit")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from vllm_specdiff_kernels import draft_logprobs_triton as dl  # noqa: E402
from vllm_specdiff_kernels import tree_attention_triton as ta  # noqa: E402


def compile_kernel(fn, types, consts, target, **options):
    """Unlisted arguments are i32 scalars; a missed pointer fails loudly in the compiler."""
    signature = {name: "constexpr" if name in consts else types.get(name, "i32")
                 for name in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, signature, consts), target=target, options=options)
    return f"{fn.__name__}: {kernel.metadata.shared} B shared"


def compile_all(capability: int) -> list[str]:
    target = GPUTarget("cuda", capability, 32)
    done = []
    for dtype, head_dim, split, in_cache in (("bf16", 128, True, True), ("fp16", 64, False, False),
                                             ("fp32", 128, False, True)):
        types = {name: f"*{dtype}" for name in ("q_ptr", "k_ptr", "v_ptr", "k_cache_ptr",
                                                "v_cache_ptr", "out_ptr")}
        types.update(block_tables_ptr="*i32", prefix_lens_ptr="*i32", cu_seqlens_ptr="*i64",
                     mask_ptr="*i32", part_out_ptr="*fp32", part_lse_ptr="*fp32",
                     qk_scale="fp32")
        consts = dict(BLOCK_SIZE=16, GROUP=4, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_M=64,
                      BLOCK_N=64 if head_dim <= 64 else 32, SPLIT=split,
                      TREE_KV_IN_CACHE=in_cache, UPCAST_DOT=False,
                      DOT_PRECISION="ieee" if dtype == "fp32" else "tf32")
        done.append(compile_kernel(ta._tree_attention_kernel, types, consts, target,
                                   num_stages=2 if dtype == "fp32" else 3))
    done.append(compile_kernel(ta._merge_splits_kernel,
                               dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16"),
                               dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=8), target))
    stats = dict(logits_ptr="*bf16", temp_ptr="*fp32", parents_ptr="*i64", m_ptr="*fp32",
                 l_ptr="*fp32", best_val_ptr="*fp32", best_idx_ptr="*i32")
    done.append(compile_kernel(dl._row_stats_kernel, stats, dict(BLOCK_V=4096), target,
                               num_warps=8))
    streak = dict(stats, tokens_ptr="*i64", draft_nodes_ptr="*i64", log_a_ptr="*fp32",
                  tau_ptr="*fp32", selected_ptr="*i64")
    done.append(compile_kernel(dl._streak_kernel, streak, dict(BLOCK_K=8, BLOCK_G=32), target))
    return done


if __name__ == "__main__":
    for line in compile_all(int(sys.argv[1]) if len(sys.argv) > 1 else 90):
        print(line)
