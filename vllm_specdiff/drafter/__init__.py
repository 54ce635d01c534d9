"""Diffusion drafters: formats (block-causal, Dream/DiffuCoder, LLaDA), loading, LoRA, vocab."""

from .base import Drafter
from .block_causal import BlockCausalDrafter
from .dream import DreamDrafter
from .llada import LLaDADrafter
from .loading import load_drafter
from .vocab import apply_reduced_vocab, build_d2t, load_d2t, save_d2t, verifier_to_draft

__all__ = [
    "BlockCausalDrafter",
    "Drafter",
    "DreamDrafter",
    "LLaDADrafter",
    "apply_reduced_vocab",
    "build_d2t",
    "load_d2t",
    "load_drafter",
    "save_d2t",
    "verifier_to_draft",
]
