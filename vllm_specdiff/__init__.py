"""vllm-specdiff: SpecDiff-2 speculative decoding with a diffusion drafter, as a vLLM plugin.

`import vllm_specdiff` never imports vLLM: the proposer class that vLLM loads through
`speculative_config.model = "vllm_specdiff.SpecDiffProposer"` is resolved lazily, so the core,
the drafter and the training code work where vLLM is not installed.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["SpecDiffProposer", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "SpecDiffProposer":
        from vllm_specdiff.plugin.proposer import SpecDiffProposer

        return SpecDiffProposer
    raise AttributeError(f"module 'vllm_specdiff' has no attribute {name!r}")
