"""The CLI's re-execution with vLLM's CPU speed settings must not put the working directory on
sys.path: run from this repository, `-m` would shadow installed packages with its folders."""

import sys

from vllm_specdiff.plugin import cpu_env


def test_reexec_runs_python_with_safe_path(monkeypatch):
    calls = []
    monkeypatch.delenv(cpu_env.APPLIED_FLAG, raising=False)
    monkeypatch.setattr(cpu_env, "recommended_env", lambda env: {"LD_PRELOAD": "libx.so"})
    monkeypatch.setattr(cpu_env.os, "execve", lambda exe, argv, env: calls.append((argv, env)))
    cpu_env.reexec_with_speed_env(["demo"])
    (argv, env), = calls
    assert argv == [sys.executable, "-P", "-m", "vllm_specdiff.cli", "demo"]
    assert env["LD_PRELOAD"] == "libx.so" and env[cpu_env.APPLIED_FLAG] == "1"
