"""`recipe run` under torchrun: two CPU processes over gloo run a tiny Qwen3 verifier's smoke
recipe; the features and training stages run on both (DDP), the others, the exports and every
record on rank 0, and a second run skips every stage on both ranks. The rank logic itself is
tested in one process too (RANK=1 set by hand)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.tiny_models import write_family_verifier
from vllm_specdiff.drafter.loading import load_drafter
from vllm_specdiff_training.cli import main
from vllm_specdiff_training.recipe import run as R
from vllm_specdiff_training.recipe import workspace as W
from vllm_specdiff_training.recipe.stages import rank_device
from vllm_specdiff_training.recipe.workspace import Workspace, digest

from .test_distributed import _free_port
from .test_recipe import GAMMA, STAGES, _end_turns_often


def _torchrun(recipe: Path, cache: Path, logs: Path) -> SimpleNamespace:
    """`recipe run --smoke` on two processes; each rank's stdout and stderr also in `logs`."""
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "--log-dir", str(logs), "--tee", "3",
           "-m", "vllm_specdiff_training.cli", "recipe", "run", str(recipe), "--smoke"]
    env = {**os.environ, "SPECDIFF_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1",
           "PYTHONSAFEPATH": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        _, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.terminate()  # torchrun ends its workers (a kill would leave them running)
        _, stderr = proc.communicate(timeout=60)
        raise AssertionError(f"torchrun timed out: {stderr[-4000:]}") from None
    ranks = {}
    for rank in (0, 1):
        folder = next(logs.glob(f"**/attempt_0/{rank}"))
        ranks[rank] = {name: (folder / f"{name}.log").read_text() for name in ("stdout", "stderr")}
    return SimpleNamespace(returncode=proc.returncode, stderr=stderr, ranks=ranks)


def _records(work: Path) -> dict[str, tuple[int, dict]]:
    return {p.name: (p.stat().st_mtime_ns, json.loads(p.read_text()))
            for p in sorted((work / "stages").iterdir())}


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe-ddp")
    verifier = write_family_verifier(root / "tinyqwen", "qwen3", hidden=64, layers=6, heads=2,
                                     kv_heads=1, head_dim=32, peak=1.0)
    _end_turns_often(verifier)
    cache, recipe = root / "cache", root / "tinyqwen.toml"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDIFF_CACHE_DIR", str(cache))
        assert main(["recipe", "new", "--verifier", str(verifier), "--output", str(recipe),
                     "--gamma", str(GAMMA), "--num-prompts", "12"]) == 0
    work = cache / "recipes" / "tinyqwen-conditioned-smoke"
    first = _torchrun(recipe, cache, root / "logs1")
    assert first.returncode == 0, first.stderr[-4000:]
    summary = json.loads((work / "summary.json").read_text())
    records = _records(work)
    second = _torchrun(recipe, cache, root / "logs2")
    assert second.returncode == 0, second.stderr[-4000:]
    return SimpleNamespace(verifier=verifier, work=work, first=first, second=second,
                           summary=summary, records=records,
                           summary2=json.loads((work / "summary.json").read_text()))


def test_two_processes_run_every_stage_once(ddp):
    assert [s["stage"] for s in ddp.summary["stages"]] == STAGES
    assert [s["status"] for s in ddp.summary["stages"]] == ["done"] * len(STAGES)
    # one record per stage, rank 0's (the other rank writes none, logs no stage, prints no
    # summary: see the one-process tests below for what it runs)
    keys = {s.replace(":", "_") + ".json" for s in STAGES}
    assert set(ddp.records) == keys
    outputs = {s["stage"]: s["outputs"] for s in ddp.summary["stages"]}
    for stage in STAGES:
        record = ddp.records[stage.replace(":", "_") + ".json"][1]
        assert json.loads(json.dumps(record["outputs"], default=str)) == outputs[stage]
    ranks = ddp.first.ranks
    assert "[1/6] generate:self1" in ranks[0]["stderr"] and "[6/6] export" in ranks[0]["stderr"]
    assert "[1/6]" not in ranks[1]["stderr"] and "rank 1 of 2" in ranks[1]["stderr"]
    assert "recipe tinyqwen-conditioned (smoke)" in ranks[0]["stdout"]
    assert "recipe tinyqwen-conditioned" not in ranks[1]["stdout"]
    # both stages trained with two processes: each rank kept its RNG state in the checkpoints
    for stage in ("stage1", "stage2"):
        checkpoint = ddp.work / "runs" / stage / "checkpoints" / "step-0000003"
        assert sorted(p.name for p in checkpoint.glob("rng-*.pt")) == ["rng-0.pt", "rng-1.pt"]
        log = [json.loads(line) for line in (ddp.work / "runs" / stage / "log.jsonl").open()]
        assert [r["step"] for r in log if r.get("loss") is not None] == [1, 2, 3]
        assert all(torch.isfinite(torch.tensor(r["loss"])) for r in log if r.get("loss"))
    # stage 2 on both ranks started from rank 0's export of stage 1
    config = json.loads((ddp.work / "runs/stage2/train_config.json").read_text())
    assert config["drafter"] == outputs["stage1"]["drafter"]
    # the features were split: each rank built its share of the shards
    shards = list((ddp.work / "data" / "self1").glob("shard-*.safetensors"))
    assert len(shards) >= 2 and outputs["features"]["shards_built"] == len(shards)
    assert "computing verifier features (taps [1, 2, 3]) for 1 shards" in ranks[1]["stderr"]
    assert outputs["eval"]["heldout"]["windows"] > 0
    drafter = load_drafter(ddp.work / "export/specdiff", verifier=ddp.verifier)
    assert tuple(drafter.feature_taps) == (1, 2, 3)


def test_a_second_run_skips_every_stage_on_both_ranks(ddp):
    assert [s["status"] for s in ddp.summary2["stages"]] == ["skipped"] * len(STAGES)
    assert _records(ddp.work) == ddp.records  # no record written again
    assert ddp.first.ranks[0]["stderr"].count("done before, skipped") == 0
    assert ddp.second.ranks[0]["stderr"].count("done before, skipped") == len(STAGES)
    # (had rank 1 not skipped a training stage, it would have waited for rank 0 until the
    # process group's timeout)
    for stage in ("stage1", "stage2"):
        assert len(list((ddp.work / "runs" / stage / "checkpoints").iterdir())) == 2


# ---- the rank logic in one process --------------------------------------------------------------
@pytest.fixture
def rank1(tmp_path, monkeypatch):
    """run_recipe as rank 1 of 2 on two made-up steps: `solo` (rank 0's) and `shared` (every
    rank's); `calls` lists the actions run, `written` the records this process wrote."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(W, "RECORD_POLL_S", 0.02)
    ws = Workspace(SimpleNamespace(name="fake"), tmp_path / "work", "verifier")
    calls: list[str] = []
    steps = [R.Step("solo", {"a": 1}, lambda: calls.append("solo") or {"made": "solo"}),
             R.Step("shared", {"b": 2}, lambda: calls.append("shared") or {"made": "shared"},
                    every_rank=True)]
    write = Workspace.write_record
    written: list[str] = []
    monkeypatch.setattr(Workspace, "write_record",
                        lambda self, step, *a: written.append(step) or write(self, step, *a))
    monkeypatch.setattr(R, "load_recipe", lambda path: ws.recipe)
    monkeypatch.setattr(Workspace, "open", classmethod(lambda cls, recipe, smoke: ws))
    monkeypatch.setattr(R, "plan", lambda _ws: steps)
    monkeypatch.setattr(R, "meet_ranks", lambda: calls.append("met rank 0"))

    def rank0(together: bool = True) -> threading.Thread:
        """Rank 0 writing its records: of `solo` a little later, of `shared` once this rank has
        run it too (`together`; else at once)."""
        def records() -> None:
            time.sleep(0.2 if together else 0.0)
            for s in steps:
                deadline = time.monotonic() + 30
                while together and s.every_rank and s.name not in calls \
                        and time.monotonic() < deadline:
                    time.sleep(0.01)
                write(ws, s.name, digest(s.settings), {"made": s.name + " on rank 0"}, 1.0)
        thread = threading.Thread(target=records)
        thread.start()
        return thread

    return SimpleNamespace(ws=ws, calls=calls, written=written, rank0=rank0, steps=steps)


def test_rank1_runs_only_the_every_rank_steps_and_waits_for_rank0s_records(rank1, tmp_path):
    thread = rank1.rank0()
    summary = R.run_recipe(tmp_path / "fake.toml")
    thread.join()
    assert rank1.calls == ["met rank 0", "shared"]
    assert rank1.written == []
    assert [(r["stage"], r["status"], r["outputs"]["made"]) for r in summary["stages"]] == \
        [("solo", "done", "solo on rank 0"), ("shared", "done", "shared on rank 0")]
    assert not (rank1.ws.root / "summary.json").exists()
    assert not (rank1.ws.root / "recipe.toml").exists()


def test_rank1_skips_what_rank0_recorded_before(rank1, tmp_path):
    rank1.rank0(together=False).join()
    summary = R.run_recipe(tmp_path / "fake.toml")
    assert rank1.calls == [] and rank1.written == []
    assert [r["status"] for r in summary["stages"]] == ["skipped", "skipped"]


def test_rank1_gives_up_when_rank0_never_records(rank1, tmp_path, monkeypatch):
    monkeypatch.setattr(W, "RECORD_WAIT_S", 0.1)
    with pytest.raises(TimeoutError, match="rank 0 never recorded stage solo"):
        R.run_recipe(tmp_path / "fake.toml")
    assert rank1.calls == []


def test_a_record_waited_for_has_the_expected_key(tmp_path, monkeypatch):
    monkeypatch.setattr(W, "RECORD_POLL_S", 0.01)
    ws = Workspace(SimpleNamespace(name="fake"), tmp_path, "verifier")
    ws.write_record("features", "old-key", {}, 1.0)  # an earlier run's, other settings
    with pytest.raises(TimeoutError):
        ws.wait_for_record("features", "new-key", timeout_s=0.05)
    ws.write_record("features", "new-key", {"shards_built": 2}, 1.0)
    assert ws.wait_for_record("features", "new-key")["outputs"] == {"shards_built": 2}
    assert [p.name for p in (tmp_path / "stages").iterdir()] == ["features.json"]


def test_each_process_builds_features_on_its_own_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert rank_device("auto") == rank_device("cuda") == "cuda:1"
    assert rank_device("cpu") == "cpu" and rank_device("cuda:0") == "cuda:0"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rank_device("auto") == "cpu"
