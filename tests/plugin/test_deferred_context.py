"""A conditioned drafter's steps without a draft project nothing (no engine): the proposer files
the verifier's states and the rows it drafts catch up in one projection, drafting what
projecting every step drafts (proposer_conditioned.py, ConditionedContextCache's backlog)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.drafter.checkpoints import write_causal_lm
from vllm_specdiff.adaptive import AdaptiveDrafting, Plan
from vllm_specdiff.drafter.conditioned import SHARED, ConditionedConfig, ConditionedDrafter

VOCAB, HIDDEN, TAPS, GAMMA = 96, 32, (0, 1), 4
PROMPTS = (5, 8, 11)  # three requests' prompt lengths
# per step: no draft, a full draft of every row, a one-row probe, and at the end two lengths
# (a probe row drafting more than the others: two drafter calls in one step)
PATTERN = [Plan(0), Plan(0), Plan(GAMMA), Plan(0), Plan(0, probe_rows=1, probe_gamma=GAMMA),
           Plan(0), Plan(0), Plan(2, probe_rows=1, probe_gamma=GAMMA)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[str, str]:
    """(verifier, conditioned drafter) directories; the drafter's own weights are large, so
    every context position visibly moves its drafts."""
    verifier = tmp_path_factory.mktemp("verifier")
    write_causal_lm(verifier, vocab=VOCAB, layers=3)
    cfg = ConditionedConfig(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, intermediate_size=64, vocab_size=VOCAB,
                            target_layer_ids=TAPS, verifier_num_layers=3, block_size=GAMMA + 1)
    model = ConditionedDrafter.from_verifier(verifier, cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in SHARED:
                p.normal_(0, 0.3) if p.dim() == 2 else p.normal_(1, 0.1)
    out = tmp_path_factory.mktemp("drafter")
    model.save_pretrained(out)
    return str(verifier), str(out)


def _proposer(model_dirs: tuple[str, str]):  # noqa: ANN202
    """SpecDiffProposer as vLLM's feature-capturing runner builds it (float32, drafter only)."""
    from vllm_specdiff.plugin.proposer import SpecDiffProposer
    from vllm_specdiff.plugin.workers import RunnerSupport

    verifier, drafter = model_dirs
    proposer = SpecDiffProposer(SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=GAMMA),
        additional_config={"specdiff": {"drafter": drafter, "log_interval": 0,
                                        "quantize": "none", "candidates": ["argmax", "sample"]}},
        model_config=SimpleNamespace(model=verifier, max_model_len=128,
                                     get_vocab_size=lambda: VOCAB, skip_tokenizer_init=True),
        scheduler_config=SimpleNamespace(max_num_seqs=4)))
    proposer.attach_runner(RunnerSupport(features=True))
    proposer.load_model(None)
    return proposer


def _serve(proposer, steps: int) -> tuple[list[list[list[int]]], list[list[int]]]:  # noqa: ANN001
    """Steps as the runner drives them: each request's newly committed positions' states
    (`observe_features`: the prompt, then one position a step; drafts are never accepted), then
    `propose`. Returns each step's drafts and the rows of each `fc` call it made."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(len(PROMPTS), 64))
    features = torch.from_numpy(rng.standard_normal((len(PROMPTS), 64, HIDDEN * len(TAPS))))
    fc_rows: list[int] = []
    hook = proposer.drafter.fc.register_forward_hook(
        lambda module, args, output: fc_rows.append(args[0].shape[-2]))
    lengths, fed = np.array(PROMPTS) + 1, [0] * len(PROMPTS)  # committed: prompt + 1 sampled
    drafts, calls = [], []
    for _ in range(steps):
        before = len(fc_rows)
        proposer.observe_features([(f"req{r}", features[r, fed[r]:n - 1].float(), fed[r])
                                   for r, n in enumerate(lengths)])
        fed = [int(n) - 1 for n in lengths]
        drafts.append(proposer.propose([[int(tokens[r, n - 1])] for r, n in enumerate(lengths)],
                                       lengths.copy(), tokens))
        calls.append(fc_rows[before:])
        lengths = lengths + 1
    hook.remove()
    return drafts, calls


def _cycling(pattern: list[Plan]):  # noqa: ANN202
    step = iter(range(10**6))
    return lambda self, *args, **kwargs: pattern[next(step) % len(pattern)]


def test_steps_without_a_draft_project_nothing_and_drafts_equal_projecting_every_step(
        model_dirs, monkeypatch):
    """With the controller choosing no draft on most steps: those steps call `fc` not at all;
    a drafting step calls it once, for exactly the drafted rows' positions filed since their
    last draft; the drafts equal a proposer that projects every step's states at once
    (max_backlog 0), which calls `fc` on every step. The idle steps and their time are
    reported."""
    monkeypatch.setattr(AdaptiveDrafting, "plan", _cycling(PATTERN))
    deferred = _proposer(model_dirs)
    drafts, calls = _serve(deferred, len(PATTERN))
    monkeypatch.setattr(AdaptiveDrafting, "plan", _cycling(PATTERN))
    eager = _proposer(model_dirs)
    assert eager.contexts is not None
    eager.contexts.max_backlog = 0
    want, eager_calls = _serve(eager, len(PATTERN))
    assert drafts == want
    drafted = [[len(d) for d in step] for step in drafts]
    assert drafted == [[0, 0, 0], [0, 0, 0], [4, 4, 4], [0, 0, 0], [4, 0, 0], [0, 0, 0],
                       [0, 0, 0], [4, 2, 2]]
    # one call per drafting step, of the drafted rows' positions filed since they were last
    # drafted: at step 2 the prompts (5, 8, 11) and two positions each; the probe row at step 4
    # (positions of steps 3 and 4); at step 7 the probe row's 3 and the others' 5, in one call
    # though the two draft lengths take two drafter calls
    assert calls == [[], [], [sum(PROMPTS) + 3 * 2], [], [2], [], [], [3 + 5 + 5]]
    assert [len(c) for c in eager_calls] == [1] * len(PATTERN)
    stats = deferred.get_stats()
    assert stats["idle_steps"] == 5 and stats["drafter_ms_per_idle_step"] > 0
    assert stats["context_projected_rows"] == sum(sum(c) for c in calls)
    assert stats["context_restarts"] == 0
