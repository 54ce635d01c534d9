"""Adaptive drafting: how many tokens to draft each step, from costs and acceptance measured
while serving. Plain Python, no vLLM import: testable with synthetic costs (tests/adaptive).
See docs/adaptive.md."""

from vllm_specdiff.adaptive.controller import AdaptiveDrafting
from vllm_specdiff.adaptive.cost import ForgettingLine, VerifierCost
from vllm_specdiff.adaptive.decision import Plan, choose
from vllm_specdiff.adaptive.estimators import (
    Acceptance,
    DraftingRuns,
    Refills,
    TailCredit,
    expected_tokens,
)
from vllm_specdiff.adaptive.params import DRAFT_MARGIN, PARAMS, AdaptiveParams
from vllm_specdiff.adaptive.shape import ShapeChoice

__all__ = [
    "DRAFT_MARGIN",
    "PARAMS",
    "Acceptance",
    "AdaptiveDrafting",
    "AdaptiveParams",
    "DraftingRuns",
    "ForgettingLine",
    "Plan",
    "Refills",
    "ShapeChoice",
    "TailCredit",
    "VerifierCost",
    "choose",
    "expected_tokens",
]
