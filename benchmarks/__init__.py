"""Benchmark scripts, installed as `vllm_specdiff_benchmarks` (run with `python -m`).

The installed `vllm-specdiff` CLI never imports this package: what it needs lives in
`vllm_specdiff` (e.g. `vllm_specdiff.harness`).
"""
