"""Tree-masked attention for vLLM's CPU attention backend, and moving committed KV entries.

vLLM's CPU kernel (`CPUAttentionBackendImpl`) only knows causal attention. For requests whose
scheduled tokens are a candidate trie, each node must see the whole cached prefix plus its own
ancestors. The wrapper installed on every attention layer runs the native kernel for the batch
and then recomputes the trie rows in torch: the prefix K/V gathered from the paged cache, the
nodes' own K/V from the forward's inputs, and the ancestor mask.

The kernel stores K and V in an ISA-specific layout inside each block (for the `vec` ISA K is
transposed). Rather than hard-coding layouts, `CacheLayout.probe` writes known values through
the kernel's own `cpu_attn_reshape_and_cache` and records where each (token, dim) element lands.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# Base for the probe's digits: integers up to 256 are exact in bfloat16 and float16.
_DIGIT = 200


@dataclass(frozen=True)
class CacheLayout:
    """key_index / value_index [block_size, head_dim]: flat offset, inside one (block, head) of
    the cache viewed as [blocks, kv_heads, 2 * block_size * head_dim], of each element."""

    block_size: int
    head_dim: int
    key_index: torch.Tensor
    value_index: torch.Tensor

    @classmethod
    def probe(cls, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype,
              isa: str) -> CacheLayout:
        """Find the layout the kernel writes, for this ISA, dtype and shape (one cache block)."""
        from vllm import _custom_ops as ops

        region = 2 * block_size * head_dim
        ident = torch.arange(block_size * head_dim).view(block_size, 1, head_dim)
        ident = ident.expand(block_size, num_kv_heads, head_dim)
        found = [torch.zeros(region, dtype=torch.long) for _ in range(2)]
        scale = 1
        for _ in range(3):  # three base-200 digits cover 8e6 elements per block
            digits = ((ident // scale) % _DIGIT + 1).to(dtype)
            cache = torch.zeros(1, num_kv_heads, block_size, 2 * head_dim, dtype=dtype)
            view = cache.view(1, num_kv_heads, 2 * block_size, head_dim)
            key_cache, value_cache = view.chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(digits, -digits, key_cache, value_cache,
                                           torch.arange(block_size), isa, k_scale=1.0,
                                           v_scale=1.0, kv_cache_dtype="auto")
            flat = cache.view(1, num_kv_heads, region)[0, 0].float().round().long()
            found[0] += (flat.clamp_min(0) - (flat > 0).long()) * scale
            found[1] += ((-flat).clamp_min(0) - (flat < 0).long()) * scale
            scale *= _DIGIT
        key_index = torch.full((block_size * head_dim,), -1, dtype=torch.long)
        value_index = torch.full((block_size * head_dim,), -1, dtype=torch.long)
        offsets = torch.arange(region)
        is_key = cache.view(1, num_kv_heads, region)[0, 0] > 0
        key_index[found[0][is_key]] = offsets[is_key]
        value_index[found[1][~is_key]] = offsets[~is_key]
        if bool((key_index < 0).any()) or bool((value_index < 0).any()):
            raise RuntimeError(f"unsupported KV cache layout for CPU attention ISA {isa!r}: "
                               "tree verification cannot read it")
        return cls(block_size, head_dim, key_index.view(block_size, head_dim),
                   value_index.view(block_size, head_dim))

    def _locate(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        blocks = slots // self.block_size
        offsets = slots % self.block_size
        return blocks, self.key_index[offsets], self.value_index[offsets]

    def flat_index(self, num_heads: int, slots: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Offsets [len(slots), heads, head_dim] of the K and V stored at the given slots in a
        contiguous cache of `num_heads` KV heads flattened: the same for every layer, so a
        forward computes them once and each layer gathers with one indexing."""
        blocks, k_idx, v_idx = self._locate(slots.long())
        region = 2 * self.block_size * self.head_dim
        base = (blocks.view(-1, 1, 1) * num_heads + torch.arange(num_heads).view(1, -1, 1)) \
            * region
        return base + k_idx.unsqueeze(1), base + v_idx.unsqueeze(1)

    def gather(self, kv_cache: torch.Tensor, slots: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [len(slots), kv_heads, head_dim] stored at the given slots."""
        heads = kv_cache.shape[1]
        region = kv_cache.view(kv_cache.shape[0], heads, -1)
        blocks, k_idx, v_idx = self._locate(slots.long())
        h = torch.arange(heads).view(1, heads, 1)
        b = blocks.view(-1, 1, 1)
        return region[b, h, k_idx.unsqueeze(1)], region[b, h, v_idx.unsqueeze(1)]

    def move(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V entries at slots src to slots dst (all sources read before writing)."""
        keys, values = self.gather(kv_cache, src)
        heads = kv_cache.shape[1]
        region = kv_cache.view(kv_cache.shape[0], heads, -1)
        blocks, k_idx, v_idx = self._locate(dst.long())
        h = torch.arange(heads).view(1, heads, 1)
        b = blocks.view(-1, 1, 1)
        region[b, h, k_idx.unsqueeze(1)] = keys
        region[b, h, v_idx.unsqueeze(1)] = values


@dataclass(frozen=True)
class TreeRequest:
    """One trie request of the batch: its query rows, cached prefix and ancestor mask."""

    query_start: int
    num_nodes: int
    prefix_len: int
    batch_index: int
    mask: torch.Tensor  # [num_nodes, num_nodes] bool


def prefix_and_ancestors(prefix_len: int, mask: torch.Tensor) -> torch.Tensor:
    """[n, prefix_len + n] bool: what each of n trie nodes attends to (the whole prefix, then
    its ancestors and itself)."""
    n = mask.shape[0]
    return torch.cat([torch.ones(n, prefix_len, dtype=torch.bool, device=mask.device), mask],
                     dim=1)


def tree_attention(query: torch.Tensor, node_keys: torch.Tensor, node_values: torch.Tensor,
                   prefix_keys: torch.Tensor, prefix_values: torch.Tensor, mask: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Attention of n trie nodes over prefix + ancestors. query [n, H, D], keys [*, Hkv, D];
    returns [n, H, D] in query's dtype (computed in float32)."""
    return masked_attention(query, torch.cat([prefix_keys, node_keys]),
                            torch.cat([prefix_values, node_values]),
                            prefix_and_ancestors(prefix_keys.shape[0], mask), scale)


def masked_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """query [n, H, D] over keys/values [m, Hkv, D] where `allowed` [n, m]; [n, H, D] in
    query's dtype, computed in float32 by torch's fused attention (grouped K/V heads are read
    without copying them)."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query.float().transpose(0, 1), keys.float().transpose(0, 1),
        values.float().transpose(0, 1), attn_mask=allowed, scale=scale,
        enable_gqa=query.shape[1] != keys.shape[1])
    return out.transpose(0, 1).to(query.dtype)


class TreeBatchContext:
    """The trie requests of the forward in progress (set by the runner around the forward).

    `memo` keeps what a platform's wrapper derives from the requests once per forward (e.g.
    the batched tensors of the CUDA path), not once per layer.
    """

    def __init__(self) -> None:
        self.requests: list[TreeRequest] = []
        self._memo: dict[str, Any] = {}

    def set(self, requests: list[TreeRequest]) -> None:
        self.requests = requests
        self._memo = {}

    def clear(self) -> None:
        self.requests = []
        self._memo = {}

    def memo(self, name: str, build: Callable[[], Any]) -> Any:
        """build() on the first call per forward, then its result."""
        if name not in self._memo:
            self._memo[name] = build()
        return self._memo[name]


def _unsupported(impl: Any) -> str | None:
    """The attention feature of `impl` that tree rows recomputed without it would get wrong."""
    # CPU: -1 or None without a window; CUDA backends: (-1, -1).
    if getattr(impl, "sliding_window", -1) not in (-1, None, (-1, -1)):
        return "sliding-window attention"
    if getattr(impl, "logits_soft_cap", 0):
        return "attention logit soft-capping"
    if getattr(impl, "alibi_slopes", None) is not None:
        return "ALiBi"
    if getattr(impl, "sinks", None) is not None:
        return "attention sinks"
    if getattr(impl, "is_fp8_kv_cache", False):
        return "an fp8 KV cache"
    cache_dtype = str(getattr(impl, "kv_cache_dtype", "auto"))  # vLLM's is_quantized_kv_cache
    if cache_dtype.startswith(("fp8", "int", "nvfp4")) or cache_dtype.endswith("per_token_head"):
        return "a quantized KV cache"
    if getattr(impl, "chunk_lookback", -1) not in (-1, None):
        return "chunked local attention"
    if getattr(impl, "kv_sharing_target_layer_name", None) is not None:
        return "cross-layer KV sharing"  # the layer gets no K/V of its own
    return None


class TreeForward:
    """Replaces one layer's `impl.forward`: the native kernel runs the batch (and writes every
    token's K/V through the slot mapping), then `recompute` overwrites the trie requests' rows
    with tree-masked attention. Platforms differ only in `recompute` and the cache layout."""

    def __init__(self, impl: Any, layout: Any, context: TreeBatchContext) -> None:
        self.native = impl.forward
        self.scale = float(impl.scale)
        self.layout = layout
        self.context = context

    def __call__(self, layer: Any, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: Any,
                 output: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = self.native(layer, query, key, value, kv_cache, attn_metadata, output, *args,
                             **kwargs)
        if attn_metadata is None or not self.context.requests:
            return result
        self.recompute(query, key, value, kv_cache, attn_metadata, output)
        return result

    def recompute(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor
                  ) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class PrefixPlan:
    """One trie request's reads, the same in every layer: the flat offsets of its K and V in a
    layer's cache (the prefix, then the nodes, which the native kernel has just written to the
    slots of positions prefix_len + j), and what each node attends to."""

    keys: torch.Tensor
    values: torch.Tensor
    allowed: torch.Tensor


class TreeMaskForward(TreeForward):
    """CPU: per trie request, its prefix and node K/V gathered through the probed layout in one
    indexing, and torch's fused attention with the ancestor mask. What is the same in every
    layer (the offsets, the mask) is made once per forward (`TreeBatchContext.memo`)."""

    def _plans(self, kv_cache: torch.Tensor, attn_metadata: Any) -> list[PrefixPlan]:
        bs = self.layout.block_size
        plans = []
        for req in self.context.requests:
            positions = torch.arange(req.prefix_len + req.num_nodes)
            blocks = attn_metadata.block_table[req.batch_index].long()
            slots = blocks[positions // bs] * bs + positions % bs
            keys, values = self.layout.flat_index(kv_cache.shape[1], slots)
            plans.append(PrefixPlan(keys, values, prefix_and_ancestors(req.prefix_len,
                                                                       req.mask)))
        return plans

    def recompute(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor
                  ) -> None:
        plans = self.context.memo("cpu_prefix", lambda: self._plans(kv_cache, attn_metadata))
        flat = kv_cache.view(-1)  # vLLM's CPU cache is one contiguous tensor per layer
        for req, plan in zip(self.context.requests, plans, strict=True):
            rows = slice(req.query_start, req.query_start + req.num_nodes)
            output[rows] = masked_attention(query[rows], flat[plan.keys], flat[plan.values],
                                            plan.allowed, self.scale)


def wrap_attention_layers(attention_layers: dict[str, Any], impl_types: tuple[type, ...],
                          backend: str, layout_for: Callable[[Any, torch.Tensor], Any],
                          wrap: Callable[[Any, Any], TreeForward]) -> Any:
    """Wrap the forward of every attention layer (once); returns the cache layout, made by
    `layout_for(layer, kv_cache)` from the first layer.

    Raises a clear error for another backend or attention features the tree path does not
    reproduce.
    """
    layout: Any = None
    for name, layer in attention_layers.items():
        impl = layer.impl
        if not isinstance(impl, impl_types):
            raise ValueError(f"tree verification (K > 1) needs {backend}; "
                             f"layer {name} uses {type(impl).__name__}")
        reason = _unsupported(impl)
        if reason is not None:
            raise ValueError(f"tree verification (K > 1) does not support {reason} "
                             f"(layer {name}); use K = 1")
        kv_cache = layer.kv_cache
        if not isinstance(kv_cache, torch.Tensor):
            raise ValueError(f"layer {name} has no KV cache tensor")
        if layout is None:
            layout = layout_for(layer, kv_cache)
        if not isinstance(impl.forward, TreeForward):
            impl.forward = wrap(impl, layout)
    if layout is None:
        raise ValueError("tree verification found no attention layers")
    return layout


def _probe_layout(layer: Any, kv_cache: torch.Tensor) -> CacheLayout:
    _, heads, block_size, _ = kv_cache.shape
    return CacheLayout.probe(heads, block_size, layer.impl.head_size, kv_cache.dtype, layer.isa)


def install_tree_attention(attention_layers: dict[str, Any], context: TreeBatchContext
                           ) -> CacheLayout:
    """Wrap the forward of every CPU attention layer; returns the probed cache layout."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    return wrap_attention_layers(attention_layers, (CPUAttentionBackendImpl,),
                                 "vLLM's CPU attention backend", _probe_layout,
                                 lambda impl, layout: TreeMaskForward(impl, layout, context))
