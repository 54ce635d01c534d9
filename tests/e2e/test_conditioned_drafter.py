"""The shipped verifier-conditioned drafter on the real verifier: it loads through
`load_drafter` with the verifier's shared tensors and drafts the verifier's own continuation."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


@torch.no_grad()
def test_shipped_conditioned_drafter_drafts_the_verifiers_greedy_text():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_specdiff.drafter.loading import load_drafter
    from vllm_specdiff.models import CONDITIONED_DRAFTER, prepare_verifier
    from vllm_specdiff_training.features import TapModel

    verifier = prepare_verifier()
    drafter = load_drafter(CONDITIONED_DRAFTER, verifier=verifier, verifier_vocab_size=49152)
    tok = AutoTokenizer.from_pretrained(str(verifier))
    model = AutoModelForCausalLM.from_pretrained(str(verifier), dtype=torch.float32).eval()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Complete this Python function.\n\ndef mean(values):\n"
                                     "    \"\"\"Return the arithmetic mean of values.\"\"\"\n"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    ids = model.generate(prompt, max_new_tokens=48, do_sample=False)
    features = TapModel(verifier, drafter.cfg.target_layer_ids)(ids)
    starts = torch.arange(prompt.shape[1] + 1, ids.shape[1] - 8, 4)[None]
    logits = drafter.window_logits(ids, starts, 8, features)
    drafts = drafter.draft_to_verifier[logits.argmax(-1)]
    targets = torch.stack([ids[0, s:s + 8] for s in starts[0].tolist()])[None]
    accepted = (drafts == targets).long().cumprod(-1).sum(-1).float().mean()
    assert torch.isfinite(logits).all()
    assert accepted > 0.3, accepted  # a trained drafter (random layers accept ~0)
