"""The autoregressive baseline drafter (`train --objective ar`): a plain causal LM, e.g. the
verifier's first N layers with its embedding, final norm and (tied) LM head, for vLLM's own
`draft_model` speculative method.

The trainer sees it through the same window interface as the diffusion drafters, so the data,
batches, losses, checkpoints and held-out measures are shared: window m's logits are the
teacher-forced next-token logits at positions s_m - 1 .. s_m + gamma - 2, i.e. draft token j is
predicted from the context and the verifier's tokens x_1..x_{j-1}. With the verifier's tokens as
the prefix this is exactly what an AR draft sees while it is still being accepted, so the
trainer's held-out expected streak and greedy accepted length are the AR drafter's true ones
(for data generated greedily). The directory it is saved as is a standard transformers
`LlamaForCausalLM` / `Qwen2ForCausalLM` directory, which vLLM loads as a draft model.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from vllm_specdiff.drafter.vocab import copy_tokenizer_files

SUPPORTED_TYPES = ("llama", "qwen2")


class CausalLMDrafter(nn.Module):
    """A transformers causal LM with the trainer's `window_logits` (see module docstring)."""

    def __init__(self, lm: nn.Module, source_dir: str | Path | None = None) -> None:
        super().__init__()
        self.lm = lm
        self.vocab_size = int(lm.config.vocab_size)
        self.max_positions = int(lm.config.max_position_embeddings)
        self.draft_to_verifier: torch.Tensor | None = None  # vLLM's draft_model needs the full head
        self.source_dir = None if source_dir is None else Path(source_dir)

    @property
    def num_layers(self) -> int:
        return int(self.lm.config.num_hidden_layers)

    @staticmethod
    def input_lookahead(gamma: int) -> int:
        """Tokens past the last window start the batch must hold: the targets' prefixes."""
        return gamma - 1

    def window_logits(self, input_ids: torch.Tensor, starts: torch.Tensor,
                      gamma: int) -> torch.Tensor:
        """Teacher-forced logits [B, M, G, V] of M windows per row, from ONE causal pass.

        input_ids must hold the verifier's tokens up to s_m + gamma - 2 for every window m (the
        batch is built with `input_lookahead(gamma)` extra tokens); positions past a row's
        sequence are padding that no read position attends to (causal attention).
        """
        device = self.lm.lm_head.weight.device
        input_ids = input_ids.to(device)
        starts = torch.as_tensor(starts, device=device, dtype=torch.long)
        if input_ids.dim() != 2 or starts.dim() != 2 or starts.shape[0] != input_ids.shape[0]:
            raise ValueError("window_logits needs input_ids[B,L] and starts[B,M]")
        batch, length = input_ids.shape
        read = (starts - 1)[:, :, None] + torch.arange(gamma, device=device)  # [B, M, G]
        if bool((starts < 1).any()) or int(read.max()) >= length:
            raise ValueError(f"a causal window needs its targets' prefix in input_ids: starts "
                             f"must be >= 1 and start + gamma - 2 < {length} (build the batch "
                             f"with lookahead = gamma - 1)")
        hidden = self.lm.model(input_ids=input_ids).last_hidden_state  # [B, L, H]
        flat = read.reshape(batch, -1)
        picked = hidden.gather(1, flat[..., None].expand(-1, -1, hidden.shape[-1]))
        return self.lm.lm_head(picked).reshape(batch, starts.shape[1], gamma, -1)

    def save_pretrained(self, path: str | Path) -> None:
        """A standard transformers directory (config.json with the kept num_hidden_layers,
        safetensors, generation config) plus the source model's tokenizer files."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.lm.save_pretrained(str(path), safe_serialization=True)
        if self.source_dir is not None and self.source_dir.resolve() != path.resolve():
            copy_tokenizer_files(self.source_dir, path)


def load_causal_drafter(model_dir: str | Path, num_layers: int | None = None) -> CausalLMDrafter:
    """A causal LM directory in float32, truncated to its first `num_layers` decoder layers
    (None: all of them); embedding, final norm and LM head (tied if the model ties them) kept."""
    from transformers import AutoModelForCausalLM

    from vllm_specdiff.drafter.checkpoint import read_config

    path = Path(model_dir)
    cfg = read_config(path)
    if cfg.get("model_type") not in SUPPORTED_TYPES:
        raise ValueError(f"--objective ar supports causal LMs of model_type {SUPPORTED_TYPES}; "
                         f"{str(model_dir)!r} has {cfg.get('model_type')!r}")
    total = int(cfg["num_hidden_layers"])
    if num_layers is not None and not 1 <= num_layers <= total:
        raise ValueError(f"--num-layers must be in [1, {total}] for {str(model_dir)!r}, "
                         f"got {num_layers}")
    extra = {} if num_layers is None else {"num_hidden_layers": num_layers}
    if cfg.get("layer_types") and num_layers is not None:
        extra["layer_types"] = cfg["layer_types"][:num_layers]
    # transformers would list every dropped layer's weights as "unexpected"
    quiet = logging.getLogger("transformers.modeling_utils")
    level = quiet.level
    quiet.setLevel(logging.ERROR if num_layers is not None else level)
    try:
        lm = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **extra)
    finally:
        quiet.setLevel(level)
    return CausalLMDrafter(lm.eval(), source_dir=path)
