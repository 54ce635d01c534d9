"""`train` under torchrun: two CPU processes over gloo share the feature stage and train one
drafter with DDP (accelerate), as a multi-GPU run would."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vllm_specdiff_training.features import TapModel, features_dir

from .conftest import make_verifier
from .test_pipeline import _generate


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(data: Path, verifier: Path, out: Path, procs: int) -> subprocess.CompletedProcess:
    torchrun = Path(sys.executable).parent / "torchrun"
    launcher = [str(torchrun), "--nproc-per-node", str(procs), "--master-addr", "127.0.0.1",
                "--master-port", str(_free_port()), "-m"] if procs > 1 else [sys.executable, "-m"]
    cmd = [*launcher, "vllm_specdiff_training.cli", "train", "--data", str(data),
           "--output", str(out), "--arch", "conditioned", "--init-from", str(verifier),
           "--num-layers", "1", "--num-taps", "2", "--gamma", "4", "--steps", "4",
           "--batch-size", "2", "--windows-per-seq", "2", "--lr", "3e-3", "--warmup-steps", "1",
           "--heldout-fraction", "0.25", "--save-every", "2", "--eval-every", "2",
           "--eval-windows", "8", "--finetune", "full", "--loss", "ce-decay",
           "--schedule", "constant"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONSAFEPATH": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, prompts_file):
    verifier = make_verifier(tmp_path_factory.mktemp("verifier"), layers=5)
    data = tmp_path_factory.mktemp("data")
    _generate(verifier, prompts_file, data, num_samples=1, temperature=0.0, top_logprobs=0,
              chunk_size=6)
    return verifier, data


def test_two_processes_build_the_features_and_train_one_drafter(small_run, tmp_path):
    verifier, data = small_run
    two = _train(data, verifier, tmp_path / "two", procs=2)
    assert two.returncode == 0, two.stderr[-3000:]
    # the feature stage was split between the ranks, and matches one process's forward
    shards = sorted(data.glob("shard-*.safetensors"))
    assert len(shards) >= 2
    taps = tuple(json.loads((tmp_path / "two" / "model" / "config.json").read_text())
                 ["target_layer_ids"])
    folder = features_dir(data, taps)
    assert all((folder / s.name).is_file() for s in shards)
    tap = TapModel(verifier, taps)
    first = load_file(str(shards[0]))
    seq = first["tokens"][:int(first["seq_offsets"][1])].long()
    stored = load_file(str(folder / shards[0].name))["features"][:seq.numel()]
    torch.testing.assert_close(stored.float(), tap(seq[None])[0].half().float())
    # one model, trained by both: each step's windows are the sum of both ranks' batches
    log_two = [json.loads(line) for line in (tmp_path / "two" / "log.jsonl").open()]
    one = _train(data, verifier, tmp_path / "one", procs=1)
    assert one.returncode == 0, one.stderr[-3000:]
    log_one = [json.loads(line) for line in (tmp_path / "one" / "log.jsonl").open()]
    steps = [r for r in log_two if r.get("loss") is not None]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert steps[0]["windows"] > [r for r in log_one if r["step"] == 1][0]["windows"]
    checkpoint = tmp_path / "two" / "checkpoints" / "step-0000004"
    assert (checkpoint / "rng-0.pt").is_file() and (checkpoint / "rng-1.pt").is_file()
    assert (tmp_path / "two" / "model" / "config.json").is_file()
    trained = load_file(str(checkpoint / "trainable.safetensors"))
    assert all(torch.isfinite(t).all() for t in trained.values())
    # the ranks drew other batches than one process does: the weights differ from its
    alone = load_file(str(tmp_path / "one" / "checkpoints" / "step-0000004" /
                          "trainable.safetensors"))
    assert any(not torch.equal(trained[k], alone[k]) for k in trained)
