"""Pieces of the CUDA tree-verification path that run without a GPU: the runner and worker
classes, the worker chosen per platform, the CUDA backends' KV cache layout, the wrapper's
install checks. (The wrapper's numbers are checked in tests/kernels/test_tree_attention_cuda.py,
which needs Triton's interpreter in its own process.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from .fake_platforms import CPU, CUDA, ROCM

pytestmark = pytest.mark.vllm


@pytest.fixture(autouse=True)
def _standalone_default_drafter(monkeypatch):
    """These tests are about the tree worker of a drafter that reads token ids: pin the
    standalone default (the conditioned default's worker: test_conditioned_tree_parts.py)."""
    from vllm_specdiff import models

    monkeypatch.setattr(models, "DEFAULT_DRAFTER_KIND", "standalone")




# ---- classes ------------------------------------------------------------------------------------
def test_gpu_runner_puts_the_mixin_first_and_overrides_the_hook():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_specdiff.plugin.tree_runner import SpecDiffRunner, TreeVerificationRunner
    from vllm_specdiff.plugin.workers_cuda import SpecDiffGPUModelRunner, SpecDiffGPUWorker

    mro = SpecDiffGPUModelRunner.__mro__
    assert mro[1:4] == (TreeVerificationRunner, SpecDiffRunner, GPUModelRunner)
    for name in ("_prepare_inputs", "_sample", "initialize_kv_cache", "propose_draft_token_ids"):
        assert getattr(SpecDiffGPUModelRunner, name) is getattr(TreeVerificationRunner, name)
    assert "_install_tree_attention" in SpecDiffGPUModelRunner.__dict__
    assert issubclass(SpecDiffGPUWorker, Worker)
    assert SpecDiffGPUWorker.runner is SpecDiffGPUModelRunner


def test_worker_names_resolve_to_the_worker_classes():
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from vllm_specdiff.plugin.workers import CPU_TREE_WORKER, GPU_TREE_WORKER
    from vllm_specdiff.plugin.workers_cpu import SpecDiffCPUWorker
    from vllm_specdiff.plugin.workers_cuda import SpecDiffGPUWorker

    assert resolve_obj_by_qualname(CPU_TREE_WORKER) is SpecDiffCPUWorker
    assert resolve_obj_by_qualname(GPU_TREE_WORKER) is SpecDiffGPUWorker


def test_gpu_worker_factory_builds_the_runner_and_refuses_the_v2_runner():
    from vllm_specdiff.plugin.workers_cuda import SpecDiffGPUWorker

    built = []
    worker = SimpleNamespace(use_v2_model_runner=False, vllm_config="cfg",
                             device=torch.device("cuda", 1), serves=SpecDiffGPUWorker.serves,
                             runner=lambda config, device: built.append((config, device))
                             or "runner")
    make = SpecDiffGPUWorker._make_model_runner
    assert make(worker) == "runner"
    assert built == [("cfg", torch.device("cuda", 1))]
    worker.use_v2_model_runner = True
    with pytest.raises(ValueError, match="tree verification .* V1 model runner"):
        make(worker)


@pytest.mark.parametrize(("mode", "splits_attention", "error"), [
    ("NONE", False, None),
    ("PIECEWISE", True, None),
    ("PIECEWISE", False, "captures it"),
    ("FULL_AND_PIECEWISE", True, "captures it"),
    ("FULL_DECODE_ONLY", True, "captures it"),
    ("FULL", True, "captures it"),
])
def test_gpu_runner_refuses_cuda_graphs_that_capture_attention(mode, splits_attention, error):
    from vllm.config.compilation import CUDAGraphMode

    from vllm_specdiff.plugin.workers_cuda import check_attention_outside_cuda_graphs

    config = SimpleNamespace(cudagraph_mode=CUDAGraphMode[mode],
                             splitting_ops_contain_attention=lambda: splits_attention)
    if error is None:
        check_attention_outside_cuda_graphs(config)
    else:
        with pytest.raises(ValueError, match=error) as info:
            check_attention_outside_cuda_graphs(config)
        assert '"cudagraph_mode": "PIECEWISE"' in str(info.value)


def test_gpu_runner_refuses_micro_batching_and_decode_context_parallelism():
    from vllm_specdiff.plugin.workers_cuda import check_parallel_config

    check_parallel_config(SimpleNamespace(use_ubatching=False, decode_context_parallel_size=1))
    with pytest.raises(ValueError, match="micro-batching"):
        check_parallel_config(SimpleNamespace(use_ubatching=True, decode_context_parallel_size=1))
    with pytest.raises(ValueError, match="decode context"):
        check_parallel_config(SimpleNamespace(use_ubatching=False, decode_context_parallel_size=2))


# ---- the worker per platform --------------------------------------------------------------------
def test_tree_worker_is_chosen_by_platform():
    from vllm_specdiff.plugin.workers import (
        CPU_TREE_WORKER,
        GPU_TREE_WORKER,
        tree_engine_args,
        tree_worker,
    )

    assert tree_worker(CPU) == CPU_TREE_WORKER
    assert tree_worker(CUDA) == GPU_TREE_WORKER
    assert tree_worker() == CPU_TREE_WORKER  # this machine: vLLM's CPU platform
    with pytest.raises(ValueError, match="CPU and CUDA platforms, not 'rocm'"):
        tree_worker(ROCM)
    assert tree_engine_args(CPU) == {"worker_cls": CPU_TREE_WORKER, "async_scheduling": False}
    assert tree_engine_args(CUDA) == {"worker_cls": GPU_TREE_WORKER, "async_scheduling": False,
                                      "compilation_config": {"cudagraph_mode": "PIECEWISE"}}


@pytest.fixture
def on_cuda(monkeypatch):
    """vLLM's current platform reads as CUDA."""
    import vllm.platforms

    assert vllm.platforms.current_platform.is_cpu()  # resolved, so monkeypatch restores it
    monkeypatch.setattr(vllm.platforms, "_current_platform", CUDA)


def test_engine_args_on_cuda_pick_the_gpu_worker_and_piecewise_graphs(on_cuda):
    from vllm_specdiff.plugin.engine import specdiff_engine_args
    from vllm_specdiff.plugin.workers import GPU_TREE_WORKER

    args = specdiff_engine_args(4, num_drafts=2, drafter_temperature=1.5)
    assert args["worker_cls"] == GPU_TREE_WORKER and args["async_scheduling"] is False
    assert args["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    assert "worker_cls" not in specdiff_engine_args(4)  # K = 1 adds nothing on CUDA either


def test_serve_argv_on_cuda_adds_each_flag_unless_given(on_cuda):
    from vllm_specdiff.commands.serve import worker_argv
    from vllm_specdiff.plugin.config import parse_specdiff_config
    from vllm_specdiff.plugin.workers import GPU_TREE_WORKER

    config = parse_specdiff_config({"specdiff": {"num_drafts": 2}}, gamma=4)
    assert worker_argv(["m"], config) == [
        "m", "--worker-cls", GPU_TREE_WORKER, "--no-async-scheduling",
        "--compilation-config", '{"cudagraph_mode": "PIECEWISE"}']
    mine = ["m", "--worker-cls=x.W", "--async-scheduling", "-O3"]
    assert worker_argv(mine, config) == mine
    assert worker_argv(["m", "-cc.cudagraph_mode=NONE"], config)[-1] == \
        "--no-async-scheduling"
    assert worker_argv(["m"], parse_specdiff_config(None)) == ["m"]


def test_k_above_one_on_an_unsupported_platform_fails_in_serve_with_a_clear_error():
    from vllm_specdiff.commands.serve import worker_argv
    from vllm_specdiff.plugin.config import parse_specdiff_config

    with pytest.raises(ValueError, match="use num_drafts = 1"):
        worker_argv(["m"], parse_specdiff_config({"specdiff": {"num_drafts": 2}}, gamma=4),
                         ROCM)


# ---- the CUDA backends' KV cache layout ---------------------------------------------------------
def _logical_cache(blocks: int, heads: int, block_size: int, dim: int, tokens_major: bool
                   ) -> torch.Tensor:
    """[blocks, heads, block_size, 2 * dim], stored tokens-major (LBNHC) or heads-major."""
    if tokens_major:
        return torch.zeros(blocks, block_size, heads, 2 * dim).permute(0, 2, 1, 3)
    return torch.zeros(blocks, heads, block_size, 2 * dim)


@pytest.mark.parametrize("tokens_major", [True, False])
def test_cuda_layout_gathers_and_moves_what_the_backend_stores(tokens_major):
    from vllm_specdiff.plugin.tree_attention_cuda import PagedKVLayout

    heads, bs, dim, blocks = 2, 16, 8, 5
    cache = _logical_cache(blocks, heads, bs, dim, tokens_major)
    assert cache.is_contiguous() != tokens_major
    layout = PagedKVLayout.for_cache(cache, dim)
    assert layout.block_size == bs
    slots = torch.tensor([0, 17, 40, 63, 79, 5])
    keys = torch.randn(len(slots), heads, dim)
    values = torch.randn(len(slots), heads, dim)
    for i, slot in enumerate(slots.tolist()):  # the backends' layout, by hand
        cache[slot // bs, :, slot % bs, :dim] = keys[i]
        cache[slot // bs, :, slot % bs, dim:] = values[i]
    # the views the backends read (kv_cache.transpose(1, 2).split(head_size, dim=-1))
    key_cache, value_cache = layout.split(cache)
    want_k, want_v = cache.transpose(1, 2).split(dim, dim=-1)
    assert key_cache.stride() == want_k.stride() and torch.equal(key_cache, want_k)
    assert torch.equal(value_cache, want_v)
    got_k, got_v = layout.gather(cache, slots)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    layout.move(cache, slots[1:3], torch.tensor([17, 70]))  # overlapping: 17 is read first
    assert torch.equal(cache[70 // bs, :, 70 % bs, :dim], keys[2])
    assert torch.equal(cache[1, :, 1, :dim], keys[1])  # slot 17 = block 1, offset 1
    moved_k, moved_v = layout.gather(cache, torch.tensor([17, 70]))
    assert torch.equal(moved_k, keys[1:3]) and torch.equal(moved_v, values[1:3])
    assert torch.equal(layout.gather(cache, slots[3:])[0], keys[3:])  # others untouched


def test_cuda_layout_rejects_a_cache_of_another_shape():
    from vllm_specdiff.plugin.tree_attention_cuda import PagedKVLayout

    with pytest.raises(ValueError, match="head_size 8"):
        PagedKVLayout.for_cache(torch.zeros(2, 16, 2, 8, 8), 8)  # 5-D
    with pytest.raises(ValueError, match="head_size 8"):
        PagedKVLayout.for_cache(torch.zeros(2, 2, 16, 18), 8)  # padded (quantized) content
    with pytest.raises(ValueError, match="innermost"):
        PagedKVLayout.for_cache(torch.zeros(2, 2, 16, 16).transpose(2, 3), 8)


# ---- installing the wrapper ---------------------------------------------------------------------
def _impl(cls: type, **overrides: object) -> object:
    """A backend impl object without running its constructor (it needs a GPU)."""
    impl = object.__new__(cls)
    attrs = dict(head_size=8, scale=0.3, sliding_window=(-1, -1), logits_soft_cap=0,
                 alibi_slopes=None, sinks=None, kv_cache_dtype="auto", chunk_lookback=-1,
                 forward=lambda *args, **kwargs: None)
    attrs.update(overrides)
    for name, value in attrs.items():
        setattr(impl, name, value)
    return impl


def _layers(*impls: object) -> dict[str, SimpleNamespace]:
    return {f"layers.{i}.attn": SimpleNamespace(impl=impl, kv_cache=torch.zeros(3, 2, 16, 16))
            for i, impl in enumerate(impls)}


def test_cuda_install_wraps_flash_and_triton_attention_once():
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    from vllm_specdiff.plugin.tree_attention import TreeBatchContext
    from vllm_specdiff.plugin.tree_attention_cuda import (
        CudaTreeMaskForward,
        PagedKVLayout,
        cuda_attention_impls,
        install_cuda_tree_attention,
    )

    assert cuda_attention_impls() == (FlashAttentionImpl, TritonAttentionImpl)
    layers = _layers(_impl(FlashAttentionImpl), _impl(TritonAttentionImpl))
    context = TreeBatchContext()
    layout = install_cuda_tree_attention(layers, context)
    assert layout == PagedKVLayout(16, 8)
    wrapped = [layer.impl.forward for layer in layers.values()]
    assert all(isinstance(f, CudaTreeMaskForward) and f.context is context for f in wrapped)
    install_cuda_tree_attention(layers, context)  # a second install does not wrap the wrapper
    assert [layer.impl.forward for layer in layers.values()] == wrapped


@pytest.mark.parametrize(("overrides", "named"), [
    ({"sliding_window": (127, 0)}, "sliding-window"),
    ({"logits_soft_cap": 30.0}, "soft-capping"),
    ({"sinks": torch.zeros(2)}, "sinks"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "quantized KV cache"),
    ({"kv_cache_dtype": "int8_per_token_head"}, "quantized KV cache"),
    ({"chunk_lookback": 8192}, "chunked local attention"),
    ({"kv_sharing_target_layer_name": "layers.0.attn"}, "KV sharing"),
])
def test_cuda_install_refuses_what_the_tree_kernel_does_not_reproduce(overrides, named):
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    from vllm_specdiff.plugin.tree_attention import TreeBatchContext
    from vllm_specdiff.plugin.tree_attention_cuda import install_cuda_tree_attention

    with pytest.raises(ValueError, match=named):
        install_cuda_tree_attention(_layers(_impl(TritonAttentionImpl, **overrides)),
                                    TreeBatchContext())


def test_cuda_install_names_the_backends_it_needs():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from vllm_specdiff.plugin.tree_attention import TreeBatchContext
    from vllm_specdiff.plugin.tree_attention_cuda import install_cuda_tree_attention

    with pytest.raises(ValueError, match="FLASH_ATTN or TRITON_ATTN.*CPUAttentionBackendImpl"):
        install_cuda_tree_attention(_layers(_impl(CPUAttentionBackendImpl)), TreeBatchContext())


def test_the_packed_batch_is_built_once_per_forward(monkeypatch):
    """All layers of one forward share one packed batch; the next forward packs anew."""
    from vllm_specdiff.plugin import tree_attention_cuda
    from vllm_specdiff_benchmarks.kernels import run_wrapper, wrapper_case

    case = wrapper_case(torch.float32, torch.device("cpu"))
    want = run_wrapper(case)
    packed = []
    real = tree_attention_cuda.pack_tree_batch
    monkeypatch.setattr(tree_attention_cuda, "pack_tree_batch",
                        lambda requests, device: packed.append(len(requests)) or
                        real(requests, device))
    context = tree_attention_cuda.TreeBatchContext()
    context.set(case.requests)
    impl = SimpleNamespace(forward=lambda *args, **kwargs: None, scale=0.25)
    layers = [tree_attention_cuda.CudaTreeMaskForward(impl, case.layout, context)
              for _ in range(3)]
    meta = SimpleNamespace(block_table=case.block_table)
    outputs = []
    for forward in layers:
        outputs.append(torch.zeros_like(case.query))
        forward(None, case.query, case.key, case.value, case.kv_cache, meta, outputs[-1])
    assert packed == [2]
    assert all(torch.equal(o, want) for o in outputs)
    context.set(case.requests[:1])
    layers[0](None, case.query, case.key, case.value, case.kv_cache, meta, outputs[0])
    assert packed == [2, 1]
