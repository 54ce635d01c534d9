"""Rows near the drafter's position limit get shorter drafts (or none), never an engine crash.

The drafter here has exactly `max_model_len` positions, as `_check_positions` allows. vLLM still
asks for drafts right after prefill when context + gamma exceeds that (its guard looks at the
sequence before the sampled token), so the proposer must shorten those drafts itself.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest

from tests.tiny_models import SPECIALS, WORDS, speculative_args

pytestmark = pytest.mark.vllm

LIMIT = 256
GAMMA = 8


@pytest.fixture(scope="module")
def short_drafter(tiny_drafter, tmp_path_factory: pytest.TempPathFactory):
    """The tiny drafter with its position encoding cut to LIMIT positions."""
    path = tmp_path_factory.mktemp("short") / "drafter"
    shutil.copytree(tiny_drafter, path)
    config = json.loads((path / "config.json").read_text())
    config["base_config"]["max_position_embeddings"] = LIMIT
    (path / "config.json").write_text(json.dumps(config))
    return path


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [len(SPECIALS) + rng.randrange(WORDS) for _ in range(length)]


def test_prompts_on_both_sides_of_the_limit_match_plain(tiny_verifier, short_drafter):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_specdiff.plugin.engine import specdiff_stats

    kwargs = dict(model=str(tiny_verifier), max_model_len=LIMIT, max_num_seqs=8, seed=0,
                  kv_cache_memory_bytes=2_000_000, dtype="float32", enforce_eager=True,
                  disable_log_stats=False)
    # 200 and 240 tokens fit a full draft; 248 is the reported crash (249 + 8 > 256); the rest
    # leave fewer than gamma positions, down to 255 (a single output token, no draft at all).
    # 240 fits a full draft; 248 is the reported crash (249 + 8 > 256); the rest leave fewer
    # than gamma positions, down to 255 (a single output token, no draft at all). vLLM skips
    # drafting for a whole batch whose longest row is too long, so each length runs alone, and
    # then all together.
    lengths = [240, 246, 247, 248, 249, 251, 253, 255]
    batches = [[n] for n in lengths] + [lengths]

    def run(llm) -> list[list[list[int]]]:
        out = []
        for batch in batches:
            prompts = [TokensPrompt(prompt_token_ids=_prompt(n, n)) for n in batch]
            params = [SamplingParams(temperature=0.0, max_tokens=LIMIT - n, ignore_eos=True)
                      for n in batch]
            out.append([list(o.outputs[0].token_ids)
                        for o in llm.generate(prompts, params, use_tqdm=False)])
        return out

    plain = LLM(**kwargs)
    expected = run(plain)
    del plain
    spec = LLM(**kwargs, **speculative_args(short_drafter, gamma=GAMMA, adaptive=False))
    got = run(spec)
    assert got == expected
    assert [len(t) for t in got[-1]] == [LIMIT - n for n in lengths]
    stats = specdiff_stats(spec)
    assert stats["proposer"]["drafter"] == str(short_drafter)
    assert stats["vllm"]["num_drafts"] > 0
    # some drafts were shorter than gamma: fewer draft tokens than gamma per draft
    assert stats["vllm"]["num_draft_tokens"] < GAMMA * stats["vllm"]["num_drafts"]


@pytest.mark.parametrize(("max_model_len", "window", "expected"), [
    (LIMIT, None, [4, 4, 3, 1, 0]),  # the drafter's positions and max_model_len coincide
    (4 * LIMIT, LIMIT - 4, [4, 4, 4, 4, 4]),  # a window keeps every context inside the drafter
])
def test_propose_shortens_drafts_at_the_limit(short_drafter, max_model_len, window, expected):
    import numpy as np

    from tests.plugin.test_options import _proposer

    options = {} if window is None else {"context_window": window}
    proposer = _proposer(short_drafter, max_model_len, gamma=4, adaptive=False, **options)
    proposer.load_model(None)
    lengths = [100, 252, 253, 255, 256]
    tokens = np.zeros((len(lengths), LIMIT), dtype=np.int64)
    for row, n in enumerate(lengths):
        tokens[row, :n] = _prompt(row, n)
    drafts = proposer.propose([[1]] * len(lengths), np.array(lengths), tokens)
    assert [len(d) for d in drafts] == expected
