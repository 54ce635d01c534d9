"""Shared tiny models for the vLLM tests (written once per session)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from tests.vllm.tiny_models import write_tiny_drafter, write_tiny_verifier  # noqa: E402


@pytest.fixture(scope="session")
def tiny_verifier(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_verifier(tmp_path_factory.mktemp("tiny") / "verifier")


@pytest.fixture(scope="session")
def tiny_drafter(tiny_verifier, tmp_path_factory: pytest.TempPathFactory):
    """Full-depth drafter: draft token 1 equals the verifier's greedy token."""
    return write_tiny_drafter(tiny_verifier, tmp_path_factory.mktemp("tiny") / "drafter")



@pytest.fixture(scope="module", autouse=True)
def _finalize_dead_engines():
    """Finalize engines that earlier modules left as garbage before this module builds its own.

    An in-process engine tears down vLLM's process-wide parallel groups when it is finalized; if
    the garbage collector reaches a dead one while a live engine runs, that engine fails with
    "pipeline model parallel group is not initialized" (seen in the whole-suite run only)."""
    import gc

    gc.collect()
    yield
