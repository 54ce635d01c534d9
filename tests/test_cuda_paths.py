"""benchmarks/cuda_paths.py (`vllm_specdiff_benchmarks.cuda_paths`) on CPU: the harness that runs
the core and the drafter on a GPU works, and its negative control fails as it must."""

import json
import subprocess
from pathlib import Path

from vllm_specdiff_benchmarks.cuda_paths import main

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_run_passes_every_check_and_writes_the_report(tmp_path):
    out = tmp_path / "cuda_paths.json"
    report = main(["--device", "cpu", "--trials", "300", "--timing-calls", "1",
                   "--json", str(out)])
    assert json.loads(out.read_text()) == report
    names = [c["check"] for c in report["checks"]]
    assert names == ["greedy K=1 point-mass", "greedy K=4 point-mass", "greedy K=4 tree",
                     "sampled T=1 K=3 point-mass", "sampled T=1 K=3 tree",
                     "negative control: sampled at T=0.5, tested against T=1",
                     "scoring: dispatch vs torch", "drafter logits: device vs CPU"], names
    assert report["passed"], report["checks"]
    control = report["checks"][5]
    assert control["p_value"] < 1e-6
    assert all(c["accepted"] > 0 for c in report["checks"][:3])  # drafts were accepted
    assert [t["batch"] for t in report["timing"]] == [1, 16]
    assert all(t["median_ms"] > 0 for t in report["timing"])
    assert report["provenance"]["command"].startswith("python -m vllm_specdiff_benchmarks")


def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")], check=True)
