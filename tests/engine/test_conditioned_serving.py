"""A verifier-conditioned drafter served two ways, losslessly and with the same acceptance:
by the plugin (its feature-capturing worker) and, exported with `--format dflash`, by vLLM's own
`dflash` method.

A briefly trained conditioned drafter for a tiny verifier decodes greedily, batch 1, fixed gamma.
Both servers' outputs must equal plain decoding, and both accepted-token counts must equal a
pure-torch speculative decode with the same drafter (`ConditionedDrafter` + the verifier in
transformers): an error in the export, the tap indexing (vLLM captures tap L before layer L + 1),
the rows of committed tokens or the context positions would change the drafts, hence the counts.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from vllm_specdiff.drafter.conditioned import ConditionedDrafter
from vllm_specdiff_training.export import ExportConfig, run_export
from vllm_specdiff_training.features import TapModel

from ..tiny_models import CONDITIONED_GAMMA

GAMMA, MAX_TOKENS = CONDITIONED_GAMMA, 24


@pytest.fixture(scope="module")
def exported(cycle_verifier, conditioned_run, tmp_path_factory):
    """(dflash export, the drafter in torch, the drafter directory) of conftest's drafter."""
    run, model = conditioned_run
    work = tmp_path_factory.mktemp("dflash")
    out = work / "dflash"
    run_export(ExportConfig(run=str(run), verifier=str(cycle_verifier), output=str(out),
                            format="dflash"))
    drafter = ConditionedDrafter.from_pretrained(model, cycle_verifier).eval()
    return out, drafter, str(model)


PROMPTS = [[5 + (7 * i + 3 * j) % 300 for j in range(8)] for i in range(4)]


@pytest.fixture(scope="module")
def reference(cycle_verifier, exported):
    """(greedy outputs, accepted draft tokens) of the plain-torch speculative decode."""
    runs = [reference_accepted(cycle_verifier, exported[1], p, MAX_TOKENS) for p in PROMPTS]
    return [r[0] for r in runs], sum(r[1] for r in runs)


# The reference drafts in float32; int8 (the CPU default) would change a draft now and then, so
# the tests that compare accepted counts ask for float32 drafting.


def _decode(llm, params) -> tuple[list[list[int]], int]:
    """Batch 1, as the reference decodes: outputs and vLLM's accepted-token counter."""
    got = [list(llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids)
           for p in PROMPTS]
    metrics = {m.name: m for m in llm.get_metrics()}
    return got, int(metrics["vllm:spec_decode_num_accepted_tokens"].value)


def _common(verifier) -> dict:
    return dict(model=str(verifier), dtype="float32", max_model_len=256,
                kv_cache_memory_bytes=2_000_000, enforce_eager=True, seed=0,
                disable_log_stats=False)


def greedy_draft(drafter: ConditionedDrafter, ids: list[int], features: torch.Tensor
                 ) -> torch.Tensor:
    """The drafter's greedy draft (verifier ids) after `ids`: one teacher-forced window; with a
    Markov head, slot by slot, each slot reading the draft so far (its own greedy path)."""
    start = torch.tensor([[len(ids)]])  # first draft position; anchor = the last token
    path: list[int] = []
    for k in range(GAMMA if drafter.markov is not None else 1):
        seq = torch.tensor([ids + path + [0] * drafter.input_lookahead(GAMMA)])
        draft = drafter.window_logits(seq, start, GAMMA, features)[0, 0].argmax(-1)
        if drafter.draft_to_verifier is not None:
            draft = drafter.draft_to_verifier[draft]
        path.append(int(draft[k]))
    return draft if drafter.markov is None else torch.tensor(path)


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
        draft = greedy_draft(drafter, ids, taps(torch.tensor([ids])))
        verify = model(torch.tensor([ids + draft.tolist()])).logits[0, len(ids) - 1:]
        target = verify.argmax(-1).tolist()
        n = 0
        while n < GAMMA and draft[n] == target[n]:
            n += 1
        accepted += n
        ids += draft[:n].tolist() + [target[n]]
    return ids[len(prompt):len(prompt) + max_tokens], accepted


def test_plain_decoding_is_what_the_reference_decodes(cycle_verifier, reference):
    from vllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = LLM(**{**_common(cycle_verifier), "disable_log_stats": True})
    expected = [list(o.outputs[0].token_ids) for o in plain.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params)]
    assert expected == reference[0]
    assert reference[1] > 0  # trained: acceptance is not trivially zero


def test_vllm_dflash_serves_the_export_losslessly_with_the_same_acceptance(cycle_verifier,
                                                                          exported, reference):
    from vllm import LLM, SamplingParams

    out = exported[0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    spec = LLM(**_common(cycle_verifier), speculative_config={
        "method": "dflash", "model": str(out), "num_speculative_tokens": GAMMA})
    got, accepted = _decode(spec, params)
    assert got == reference[0]
    assert accepted == reference[1]
    del spec

    # negative control: the same export with the mask embedding dropped drafts differently,
    # and the count shows it
    broken = out.parent / "broken"
    shutil.copytree(out, broken)
    (broken / "mask_embedding.pt").unlink()
    spec = LLM(**_common(cycle_verifier), speculative_config={
        "method": "dflash", "model": str(broken), "num_speculative_tokens": GAMMA})
    assert _decode(spec, params)[1] != reference[1]


def test_the_plugin_serves_the_drafter_with_vllm_dflash_acceptance(cycle_verifier, exported,
                                                                   reference):
    from vllm import LLM, SamplingParams

    from vllm_specdiff.plugin.engine import specdiff_engine_args, specdiff_stats
    from vllm_specdiff.plugin.workers import CPU_CONDITIONED_WORKER

    args = specdiff_engine_args(GAMMA, drafter=exported[2], adaptive=False, quantize="none",
                                candidates=["argmax", "sample"], log_interval=0)
    assert args["worker_cls"] == CPU_CONDITIONED_WORKER
    llm = LLM(**_common(cycle_verifier), **args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got, accepted = _decode(llm, params)
    assert got == reference[0]
    assert accepted == reference[1]  # = vLLM's dflash on the export (the test above)
    proposer = specdiff_stats(llm)["proposer"]
    assert proposer["context_restarts"] == 0  # every step's positions followed the last


def test_the_plugin_serves_a_markov_headed_drafter_losslessly(cycle_verifier, exported,
                                                            reference, tmp_path):
    """A Markov head (drafter/markov.py, random here) served: plain decoding's output, and the
    accepted count of the torch reference that drafts each slot from the drafter's own greedy
    path, which differs from the headless drafter's (the served drafts read the head)."""
    from vllm import LLM, SamplingParams

    from vllm_specdiff.plugin.engine import specdiff_engine_args

    headed = ConditionedDrafter.from_pretrained(exported[2], cycle_verifier)
    headed.add_markov(4, seed=0)
    with torch.no_grad():  # large enough to move drafts of the confident trained drafter
        headed.markov.w_a.weight.normal_(0, 1.0)
        headed.markov.w_b.weight.normal_(0, 1.0)
        headed.markov.w_out.weight.normal_(0, 0.5)
    headed.save_pretrained(tmp_path / "headed")
    want = sum(reference_accepted(cycle_verifier, headed.eval(), p, MAX_TOKENS)[1]
               for p in PROMPTS)
    args = specdiff_engine_args(GAMMA, drafter=str(tmp_path / "headed"), adaptive=False,
                                quantize="none", candidates=["argmax", "sample"], log_interval=0)
    llm = LLM(**_common(cycle_verifier), **args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got, accepted = _decode(llm, params)
    assert got == reference[0]  # plain decoding
    assert accepted == want != reference[1]


def test_a_tap_one_layer_off_accepts_differently(cycle_verifier, exported, reference,
                                                monkeypatch):
    """Negative control of the tap indexing: capturing before layer L (vLLM's aux id L, Hugging
    Face's hidden_states[L]) instead of L + 1 changes the accepted count."""
    from vllm import LLM, SamplingParams

    from vllm_specdiff.plugin import conditioned_runner
    from vllm_specdiff.plugin.engine import specdiff_engine_args

    monkeypatch.setattr(conditioned_runner, "AUX_LAYER_OFFSET", 0)
    args = specdiff_engine_args(GAMMA, drafter=exported[2], adaptive=False, quantize="none",
                                candidates=["argmax", "sample"], log_interval=0)
    llm = LLM(**_common(cycle_verifier), **args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got, accepted = _decode(llm, params)
    assert got == reference[0]  # still lossless
    assert accepted != reference[1]


def test_the_plugin_refuses_a_conditioned_drafter_without_its_worker(cycle_verifier, exported):
    from vllm import LLM

    from vllm_specdiff.plugin.engine import specdiff_engine_args

    args = specdiff_engine_args(GAMMA, drafter=exported[2], log_interval=0)
    del args["worker_cls"]
    with pytest.raises(Exception, match="needs the worker that captures them"):
        LLM(**_common(cycle_verifier), **args)


def test_chunked_prefill_and_the_defaults_keep_every_position(cycle_verifier, exported):
    """A 40-token prompt prefilled in chunks of 16 feeds the context piece by piece: the plugin
    still accepts what the reference does, with no restart; with the defaults (adaptive
    drafting, prompt lookup) the output stays plain decoding's."""
    from vllm import LLM, SamplingParams

    from vllm_specdiff.plugin.engine import specdiff_engine_args, specdiff_stats

    prompt = [5 + (11 * j) % 300 for j in range(40)]
    want, accepted = reference_accepted(cycle_verifier, exported[1], prompt, MAX_TOKENS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    chunked = {**_common(cycle_verifier), "enable_chunked_prefill": True,
               "max_num_batched_tokens": 16, "enable_prefix_caching": False}
    llm = LLM(**chunked, **specdiff_engine_args(GAMMA, drafter=exported[2], adaptive=False,
                                                quantize="none", log_interval=0,
                                                candidates=["argmax", "sample"]))
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
    metrics = {m.name: m for m in llm.get_metrics()}
    assert list(out) == want
    assert int(metrics["vllm:spec_decode_num_accepted_tokens"].value) == accepted
    assert specdiff_stats(llm)["proposer"]["context_restarts"] == 0
    del llm
    llm = LLM(**_common(cycle_verifier),
              **specdiff_engine_args(GAMMA, drafter=exported[2], log_interval=0))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [list(o.outputs[0].token_ids) for o in outs] == \
        [reference_accepted(cycle_verifier, exported[1], p, MAX_TOKENS)[0] for p in PROMPTS]


def test_preemption_keeps_the_output_and_each_requests_context(cycle_verifier, exported):
    """A KV cache too small for the batch makes vLLM preempt requests and recompute them: a
    resumed request's states arrive again from an earlier position, and its context must be cut
    back there (not restarted, not duplicated) while the output stays plain decoding's."""
    from vllm import LLM, SamplingParams

    from tests.tiny_models import preempting_engine_kwargs
    from vllm_specdiff.plugin.engine import specdiff_engine_args, specdiff_stats

    prompts = [[5 + (7 * i + 3 * j) % 300 for j in range(5 + 13 * i)] for i in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)

    def run(llm) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]

    engine = preempting_engine_kwargs(cycle_verifier)
    plain = LLM(**engine)
    want = run(plain)
    del plain
    llm = LLM(**engine, **specdiff_engine_args(GAMMA, drafter=exported[2], log_interval=0,
                                               adaptive=False, candidates=["argmax", "sample"]))
    assert run(llm) == want
    preemptions = sum(getattr(m, "value", 0) or 0 for m in llm.get_metrics()
                      if m.name == "vllm:num_preemptions")
    assert preemptions > 0, "no preemption happened"
    proposer = specdiff_stats(llm)["proposer"]
    assert proposer["context_restarts"] == 0
    accepted = {m.name: m for m in llm.get_metrics()}["vllm:spec_decode_num_accepted_tokens"]
    assert accepted.value > 0
