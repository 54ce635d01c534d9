"""`"selection": "tree"`: tries committed with the multi-candidate tree walk inside vLLM.

Greedy outputs must equal plain decoding token for token (the walk reduces to following the
argmax; the swapped drafter makes the argmax draft wrong, so accepted paths run through other
candidates and their KV moves), with ragged batches, preemption and long outputs. At
temperature 1 the first three tokens must be distributed as with plain sampling, and the same
test must reject a walk that forgets the children it already rejected.
Requests the walk cannot serve exactly commit the tau chain through vLLM's rejection sampler.
"""

from __future__ import annotations

import gc

import pytest
import torch

from tests.engine.test_tree import (  # noqa: F401 - plain_outputs, small_models: fixtures
    SAMPLES,
    _counter,
    _engine_kwargs,
    _first_three,
    _p_value,
    _prompts,
    _proposer_stats,
    _runner,
    _swap_top_two,
    _tree_args,
    plain_outputs,
    plain_samples_then_engine,
    plain_then_swapped,
    small_models,
)

pytestmark = pytest.mark.vllm


def _walk_args(drafter, gamma: int, k: int) -> dict:
    return _tree_args(drafter, gamma, k, selection="tree")


# ---- greedy ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("k", "gamma"), [(2, 4), (4, 4), (2, 8), (4, 8)])
def test_greedy_tree_walk_identical_to_plain(tiny_verifier, tiny_drafter, plain_outputs,  # noqa: F811
                                             k, gamma):
    from vllm import LLM, SamplingParams

    spec = LLM(**_engine_kwargs(tiny_verifier), **_walk_args(tiny_drafter, gamma, k))
    spec.collective_rpc(_swap_top_two)
    params = SamplingParams(temperature=0.0, max_tokens=72, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in spec.generate(_prompts(), params,
                                                               use_tqdm=False)]
    assert got == plain_outputs
    assert _counter(spec, "vllm:num_preemptions") > 0, "no preemption happened"
    tree = spec.collective_rpc(_proposer_stats)[0]["tree"]
    assert tree["steps"] > 50 and tree["tree_walk_steps"] == tree["steps"]
    assert sum(tree["chosen_draft_histogram"][1:]) > 10, tree  # paths through other candidates
    drafts = _counter(spec, "vllm:spec_decode_num_drafts")
    assert _counter(spec, "vllm:spec_decode_num_draft_tokens") == gamma * drafts
    del spec
    gc.collect()


def test_requests_the_walk_cannot_serve_commit_the_tau_chain(tiny_verifier, tiny_drafter):
    """Sample logprobs and min_tokens need vLLM's chain: those requests commit the tau chain
    (exact logprobs), the plain one is walked; all outputs equal plain decoding."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, min_tokens=4),
              SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)]
    expected, got, tree = plain_then_swapped(tiny_verifier, _walk_args(tiny_drafter, 4, 4),
                                             params)
    assert [list(o.outputs[0].token_ids) for o in got] == \
        [list(o.outputs[0].token_ids) for o in expected]
    # one of the three requests is walked: about a third of the trie steps
    assert 0 < tree["tree_walk_steps"] < 0.6 * tree["steps"], tree
    for mine, ref in zip(got[0].outputs[0].logprobs, expected[0].outputs[0].logprobs,
                         strict=True):
        assert set(mine) == set(ref)
        for token, entry in ref.items():
            assert mine[token].logprob == pytest.approx(entry.logprob, abs=1e-3)


# ---- temperature 1 --------------------------------------------------------------------------
def _walk_forgetting_rejected_children(node_probs, tree, generator=None):
    """Negative control: a tree walk that forgets the children it already rejected, child i is
    accepted with p(c_i) instead of p(c_i) renormalised over the children left, and when all
    are rejected the token is drawn from p itself instead of p without them (one request).
    Measured here: the first half alone (un-renormalised acceptance) moves the first three
    tokens too little for 500 samples (p 0.05-0.14); both halves give p ~ 1e-6."""
    from vllm_specdiff.core import Verdict

    probs = node_probs.float().cpu()
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    out = torch.full((1, tree.gamma + 1), -1, dtype=torch.long)
    nodes = torch.full((1, tree.gamma), -1, dtype=torch.long)
    node = depth = 0
    while True:
        accepted = -1
        for child in (c for c, parent in enumerate(parents) if parent == node):
            if float(torch.rand((), generator=generator)) < float(probs[node, tokens[child]]):
                accepted = child
                break
        if accepted < 0:
            out[0, depth] = int(torch.multinomial(probs[node], 1, generator=generator))
            break
        out[0, depth], nodes[0, depth] = tokens[accepted], accepted
        node, depth = accepted, depth + 1
    return Verdict(out, torch.tensor([depth]), nodes)


def _install_forgetful_walk(worker) -> None:
    _runner(worker).tree_rule = _walk_forgetting_rejected_children


def _record_generators(worker) -> None:
    """Wrap the walk to record, per call, whether it got a per-request generator."""
    runner = _runner(worker)
    rule = runner.tree_rule
    runner.walk_generators = calls = []

    def recording(node_probs, tree, generator=None):
        calls.append(generator is not None)
        return rule(node_probs, tree, generator)

    runner.tree_rule = recording


def _walk_generators(worker) -> list[bool]:
    return _runner(worker).walk_generators


def test_temperature_one_tree_walk_matches_plain_sampling(small_models):  # noqa: F811
    from vllm import SamplingParams

    verifier, drafter = small_models
    reference, spec, prompt = plain_samples_then_engine(verifier, _walk_args(drafter, 4, 4))
    walked = _first_three(spec, prompt, 100_000)
    tree = spec.collective_rpc(_proposer_stats)[0]["tree"]
    assert tree["steps"] >= SAMPLES and tree["tree_walk_steps"] == tree["steps"], tree
    # the walk went past a first child often: the renormalisation below is exercised
    assert tree["tree_walk_steps_trying_several_children"] > SAMPLES // 4, tree
    # vLLM counts the walked rows; the rest is steps whose candidates all coincided (a chain,
    # verified natively), at most gamma accepted each
    untracked = _counter(spec, "vllm:spec_decode_num_accepted_tokens") - tree["accepted_tokens"]
    assert 0 <= untracked <= 4 * (_counter(spec, "vllm:spec_decode_num_drafts") - tree["steps"])
    # seeded requests walk with their own generator, unseeded ones with the global one
    spec.collective_rpc(_record_generators)
    spec.generate([prompt] * 4, [SamplingParams(temperature=1.0, max_tokens=3, seed=s)
                                 for s in (1, 2, None, None)], use_tqdm=False)
    seeded = spec.collective_rpc(_walk_generators)[0]
    assert True in seeded and False in seeded, seeded
    spec.collective_rpc(_install_forgetful_walk)
    wrong = _first_three(spec, prompt, 200_000)
    del spec
    gc.collect()
    p_walked, p_wrong = _p_value(reference, walked), _p_value(reference, wrong)
    print(f"p-values: tree walk {p_walked:.3g}, forgetful walk {p_wrong:.3g}")
    assert p_walked > 1e-3
    assert p_wrong < 1e-4  # measured 6.5e-7
