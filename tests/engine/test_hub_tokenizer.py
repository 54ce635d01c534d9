"""A verifier tokenizer named by a hub id (not a directory) must work as a local one does.

The hub cache is faked offline: the tiny tokenizer's files as a snapshot of
`specdiff-test/tiny-tokenizer` in a private HF_HUB_CACHE, with HF_HUB_OFFLINE=1. Offline, vLLM's
EngineArgs would swap the id for the snapshot path; online it keeps the id, which is what a user
serving `ORG/NAME` gets, so the script switches that swap off. Before the fix the proposer read
`model_config.tokenizer` as a directory and failed with FileNotFoundError. The engine runs in a
subprocess so the hub settings never leak into other tests.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import speculative_args, word_prompt

pytestmark = pytest.mark.vllm

HUB_ID = "specdiff-test/tiny-tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

SCRIPT = """
import json, sys
import vllm.engine.arg_utils
from vllm import LLM, SamplingParams
vllm.engine.arg_utils.get_model_path = lambda model, revision=None: model  # keep the hub id
kwargs, spec, prompts = json.loads(sys.argv[1])
params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
out = {}
for name, extra in (("plain", {}), ("spec", spec)):
    llm = LLM(**kwargs, **extra)
    out[name] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    out[name + "_tokenizer"] = llm.llm_engine.vllm_config.model_config.tokenizer
    del llm
print("RESULT " + json.dumps(out))
"""


def _fake_hub(cache: Path, tokenizer_dir: Path) -> None:
    repo = cache / ("models--" + HUB_ID.replace("/", "--"))
    commit = "0" * 40
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_tokenizer_by_hub_id(tmp_path, tiny_verifier, tiny_drafter):
    assert not Path(HUB_ID).exists()
    _fake_hub(tmp_path / "hub", tiny_verifier)
    kwargs = dict(model=str(tiny_verifier), tokenizer=HUB_ID, max_model_len=256, seed=0,
                  kv_cache_memory_bytes=2**22, dtype="float32", enforce_eager=True)
    prompts = [word_prompt(i, 6 + 5 * i) for i in range(3)]
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    arg = json.dumps([kwargs, speculative_args(tiny_drafter, gamma=3, adaptive=False), prompts])
    proc = subprocess.run([sys.executable, "-c", SCRIPT, arg], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    assert result["spec_tokenizer"] == HUB_ID  # the engine really saw the id, not a path
    assert result["spec"] == result["plain"]
    assert all(len(t) == 16 for t in result["spec"])
