"""Engine tests: each module builds vLLM engines in this process."""

from __future__ import annotations

import pytest

from tests.tiny_models import CONDITIONED_GAMMA


@pytest.fixture(scope="module", autouse=True)
def _finalize_dead_engines():
    """Finalize engines that earlier modules left as garbage before this module builds its own.

    An in-process engine tears down vLLM's process-wide parallel groups when it is finalized; if
    the garbage collector reaches a dead one while a live engine runs, that engine fails with
    "pipeline model parallel group is not initialized" (seen in the whole-suite run only)."""
    import gc

    gc.collect()
    yield


@pytest.fixture(scope="session")
def cycle_verifier(tmp_path_factory):
    """Greedy text that mostly settles into a 20-word loop (learnable, so acceptance is not
    zero), with layers whose outputs differ (so a tap one layer off reads other states)."""
    from tests.tiny_models import write_cycle_verifier

    return write_cycle_verifier(tmp_path_factory.mktemp("cycle") / "verifier",
                                cycle=list(range(10, 30)), layer_scale=0.5)


@pytest.fixture(scope="session")
def conditioned_run(cycle_verifier, tmp_path_factory):
    """(training run directory, drafter directory) of a 1-layer, one-tap conditioned drafter
    trained for seconds on the cycle verifier's greedy text; shared by every engine test of
    the format (one training per session)."""
    import json
    from pathlib import Path

    import torch

    from vllm_specdiff_training.generate import GenerateConfig, run_generate
    from vllm_specdiff_training.trainer import TrainConfig, run_train

    work = tmp_path_factory.mktemp("conditioned")
    prompts = work / "prompts.jsonl"
    gen = torch.Generator().manual_seed(0)
    prompts.write_text("".join(json.dumps(
        " ".join(f"w{int(t)}" for t in torch.randint(0, 300, (6,), generator=gen))) + "\n"
        for _ in range(48)))
    run_generate(GenerateConfig(verifier=str(cycle_verifier), prompts=str(prompts),
                                output=str(work / "data"), num_samples=1, temperature=0.0,
                                max_new_tokens=32, chunk_size=16, backend="transformers",
                                chat_template=False))
    summary = run_train(TrainConfig(
        data=str(work / "data"), output=str(work / "run"), init_from=str(cycle_verifier),
        arch="conditioned", num_layers=1, num_taps=1, gamma=CONDITIONED_GAMMA, finetune="full",
        loss="ce-decay", steps=120, lr=1e-2, warmup_steps=5, schedule="constant",
        batch_size=8, windows_per_seq=8, heldout_fraction=0.1, save_every=120))
    return work / "run", Path(summary["model"])
