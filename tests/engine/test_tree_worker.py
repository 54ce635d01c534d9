"""K > 1 needs the tree-verifying worker: without it the engine refuses to start, naming the
flag to add."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def test_k_above_one_without_the_tree_worker_fails_at_load(tiny_verifier, tiny_drafter):
    from vllm import LLM

    from tests.tiny_models import speculative_args

    with pytest.raises(Exception, match="--worker-cls"):
        LLM(model=str(tiny_verifier), max_model_len=128, kv_cache_memory_bytes=200_000,
            dtype="float32", enforce_eager=True,
            **speculative_args(tiny_drafter, gamma=4, num_drafts=2, adaptive=False))
