"""benchmarks/kernels.py (`vllm_specdiff_benchmarks.kernels`) runs on CPU (torch paths only)
and its baselines agree."""

import json

import pytest
import torch

from vllm_specdiff_benchmarks.kernels import (
    AttentionShape,
    LogprobShape,
    bench_attention,
    bench_logprobs,
    main,
)

# Triton's interpreter converts arrays to index scalars the way NumPy >= 1.25 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")


def test_cpu_benchmark_writes_a_table(tmp_path):
    out = tmp_path / "kernels.md"
    table = main(["--device", "cpu", "--dtype", "float32", "--repeats", "1",
                  "--output", str(out), "--json", str(tmp_path / "kernels.json")])
    assert out.read_text() == table
    report = json.loads((tmp_path / "kernels.json").read_text())
    assert report["provenance"]["command"].endswith("--json " + str(tmp_path / "kernels.json"))
    assert [r["impl"] for r in report["rows"]] == [
        line.split("|")[3].strip() for line in table.splitlines()
        if line.startswith(("| tree", "| draft"))]
    assert all(r["gbps"] > 0 and r["percent_of_peak"] is None for r in report["rows"])
    rows = [line for line in table.splitlines() if line.startswith("| tree") or
            line.startswith("| draft")]
    impls = [row.split("|")[3].strip() for row in rows]
    assert impls == ["SDPA dense mask (CPU)", "torch reference (CPU)", "unfused torch (CPU)",
                     "torch via dispatch (CPU)", "torch via dispatch (CPU)"]  # the tree wrapper
    for row in rows:
        assert float(row.split("|")[4]) > 0  # a time was measured
        assert float(row.split("|")[7]) < 1e-4  # SDPA with a dense mask matches the reference


def test_triton_rows_run_in_the_interpreter(monkeypatch):
    monkeypatch.setenv("SPECDIFF_KERNELS", "triton")
    cpu = torch.device("cpu")
    rows = bench_attention(AttentionShape(2, 40, 2, 3, 4, 2, 64), torch.float32, cpu, 1)
    rows += bench_logprobs(LogprobShape(2, 3, 3, 700), torch.float32, cpu, 1)
    assert [r.impl for r in rows] == [
        "SDPA dense mask (CPU)", "Triton paged (CPU interpreter)",
        "unfused torch (CPU)", "Triton fused (CPU interpreter)"]
    assert all(r.seconds > 0 and r.nbytes > 0 for r in rows)
    assert all(r.max_diff < 1e-4 for r in rows)
