"""Drafter quantisation: the cheap drafting path on CPU.

A drafter only proposes; the verifier decides what is committed, so a quantised drafter changes
acceptance, never the output. On this project's CPUs (AVX2, no AVX512-BF16) a float32 drafter
step costs nearly a verifier step, while dynamic int8 `nn.Linear`s (weights int8, activations
quantised per call, fbgemm/x86 kernels) cost a fraction of it. On CUDA the drafter runs in bf16
and is not quantised.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

QUANTIZE_MODES = ("auto", "none", "int8")


def resolve_quantize(mode: str, device: str | torch.device) -> str:
    """`auto` is int8 on CPU and none elsewhere; explicit modes are checked against the device."""
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {list(QUANTIZE_MODES)}, got {mode!r}")
    on_cpu = torch.device(device).type == "cpu"
    if mode == "auto":
        return "int8" if on_cpu else "none"
    if mode == "int8" and not on_cpu:
        raise ValueError("quantize='int8' (dynamic int8 linears) runs on CPU only; use 'none' "
                         "(bf16) on GPUs")
    return mode


def quantize_drafter(drafter: nn.Module, mode: str) -> nn.Module:
    """Quantise every `nn.Linear` of a float32 CPU drafter in place (mode 'int8'), or do nothing.

    Embeddings and norms stay float32, and so do the linears a drafter names in
    `float_linears`: int8 activations share one scale per tensor, so a layer whose inputs carry
    the verifier's massive activations (a conditioned drafter's `fc` reads raw residual streams,
    where one channel reaches ~10^4 against a median of ~2) would lose every other channel. Call
    after LoRA merging and dtype/device placement.
    """
    if mode == "none":
        return drafter
    if mode != "int8":
        raise ValueError(f"quantize_drafter: mode must be 'none' or 'int8', got {mode!r}")
    param = next(drafter.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32:
        raise ValueError(f"int8 quantisation needs a float32 CPU drafter, got {param.dtype} on "
                         f"{param.device}")
    with warnings.catch_warnings():  # torch.ao.quantization announces its successor on every call
        warnings.simplefilter("ignore")
        keep = set(getattr(drafter, "float_linears", ()))
        spec = {name: torch.ao.quantization.default_dynamic_qconfig
                for name, module in drafter.named_modules()
                if isinstance(module, nn.Linear) and name not in keep}
        torch.ao.quantization.quantize_dynamic(drafter, spec, dtype=torch.qint8, inplace=True)
    drafter.quantization = mode
    return drafter
