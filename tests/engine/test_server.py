"""`vllm-specdiff serve` with the SpecDiff proposer: OpenAI endpoints and /metrics.

The server binds 127.0.0.1 on a free port, every wait is bounded, and it is stopped by its pid.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

pytestmark = pytest.mark.vllm

STARTUP_TIMEOUT_S = 240
GAMMA = 3


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _serving(tiny_verifier, tiny_drafter, log_path, options: dict):
    """`vllm-specdiff serve` with these SpecDiff options until the block ends: (base URL, model,
    log path)."""
    import requests

    port = _free_port()
    # the shorthand spelling; tests/plugin/test_options.py checks it expands to
    # --speculative-config plus the drafter merged into --additional-config
    cmd = [sys.executable, "-P", "-m", "vllm_specdiff.cli", "serve", str(tiny_verifier),
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256",
           "--max-num-seqs", "4", "--enforce-eager", "--dtype", "float32",
           "--speculative-model", str(tiny_drafter), "--num-speculative-tokens", str(GAMMA),
           "--additional-config", json.dumps({"specdiff": options})]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n"
                            f"{log_path.read_text()[-3000:]}")
            try:
                if requests.get(base + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n"
                            f"{log_path.read_text()[-3000:]}")
            time.sleep(1)
        yield base, str(tiny_verifier), log_path
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        log.close()


@pytest.fixture(scope="module")
def server(tiny_verifier, tiny_drafter, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with _serving(tiny_verifier, tiny_drafter, log_path, {"log_interval": 0.5}) as served:
        yield served


def _stream(base: str, path: str, body: dict) -> list[dict]:
    import requests

    chunks = []
    with requests.post(base + path, json={**body, "stream": True}, stream=True,
                       timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            chunks.append(json.loads(data))
    return chunks


def test_completions_plain_and_streaming_agree(server):
    import requests

    base, model, _ = server
    body = {"model": model, "prompt": "w1 w2 w3 w4", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    r = requests.post(base + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    full = r.json()
    text = full["choices"][0]["text"]
    assert full["usage"]["completion_tokens"] == 16
    streamed = "".join(c["choices"][0]["text"] for c in _stream(base, "/v1/completions", body))
    assert streamed == text


def test_chat_completions_plain_and_streaming_agree(server):
    import requests

    base, model, _ = server
    body = {"model": model, "messages": [{"role": "user", "content": "w5 w6 w7"}],
            "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = requests.post(base + "/v1/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    content = r.json()["choices"][0]["message"]["content"]
    assert r.json()["usage"]["completion_tokens"] == 12
    chunks = _stream(base, "/v1/chat/completions", body)
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == content


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_show_spec_decode_counters(server):
    import requests

    base, model, log_path = server
    body = {"model": model, "prompt": "w9 w8 w7", "max_tokens": 20, "temperature": 0,
            "ignore_eos": True}
    requests.post(base + "/v1/completions", json=body, timeout=120).raise_for_status()
    text = requests.get(base + "/metrics", timeout=30).text
    drafts = _metric(text, "vllm:spec_decode_num_drafts_total")
    draft_tokens = _metric(text, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _metric(text, "vllm:spec_decode_num_accepted_tokens_total")
    first = _metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0")
    assert drafts > 0
    assert drafts <= draft_tokens <= GAMMA * drafts  # adaptive drafting: 1..GAMMA per draft
    assert 0 < accepted <= draft_tokens
    assert first > 0
    time.sleep(1.0)
    requests.post(base + "/v1/completions", json=body, timeout=120).raise_for_status()
    deadline = time.monotonic() + 10
    while "SpecDiff drafter:" not in log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "SpecDiff drafter:" in log_path.read_text()


def _completion(base: str, model: str, prompt: str, max_tokens: int) -> dict:
    import requests

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    r = requests.post(base + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()


def test_serve_with_four_candidates_matches_one(server, tiny_verifier, tiny_drafter,
                                                tmp_path):
    """K = 4 through `vllm-specdiff serve` (it adds the tree worker): greedy text equal to the
    K = 1 server's, trie steps logged, and /metrics counting the committed path only."""
    import requests

    prompts = ["w1 w2 w3 w4", "w7 w3 w7 w3 w7", "w2 w9"]
    base1, model, _ = server
    expected = [_completion(base1, model, p, 24)["choices"][0]["text"] for p in prompts]
    options = {"num_drafts": 4, "candidates": ["argmax", "sample"], "drafter_temperature": 1.5,
               "max_tree_tokens": 4 * GAMMA + 1, "adaptive": False, "log_interval": 0.5}
    with _serving(tiny_verifier, tiny_drafter, tmp_path / "server_k4.log", options) as served:
        base, _, log_path = served
        got = [_completion(base, model, p, 24) for p in prompts]
        assert [g["choices"][0]["text"] for g in got] == expected
        assert all(g["usage"]["completion_tokens"] == 24 for g in got)
        text = requests.get(base + "/metrics", timeout=30).text
        deadline = time.monotonic() + 10
        while "self-selection (K=4)" not in log_path.read_text() and time.monotonic() < deadline:
            _completion(base, model, prompts[0], 4)
            time.sleep(0.5)
        assert "self-selection (K=4)" in log_path.read_text()
    drafts = _metric(text, "vllm:spec_decode_num_drafts_total")
    draft_tokens = _metric(text, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _metric(text, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0
    assert draft_tokens == GAMMA * drafts  # the committed chain of each trie, not its nodes
    assert 0 <= accepted <= draft_tokens
