"""A drafter that reads the verifier: the worker it needs, its settings, its committed rows."""

import numpy as np
import pytest

from tests.drafter.checkpoints import write_causal_lm


@pytest.fixture(scope="module")
def conditioned_dir(tmp_path_factory):
    from vllm_specdiff.drafter.conditioned import ConditionedConfig, ConditionedDrafter

    verifier = tmp_path_factory.mktemp("v")
    write_causal_lm(verifier, vocab=96, layers=3)
    cfg = ConditionedConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, intermediate_size=64, vocab_size=96,
                            target_layer_ids=(0, 1), verifier_num_layers=3, block_size=5)
    out = tmp_path_factory.mktemp("conditioned")
    ConditionedDrafter.from_verifier(verifier, cfg).save_pretrained(out)
    return str(out)


def test_a_conditioned_drafter_selects_the_feature_capturing_worker(conditioned_dir):
    from vllm_specdiff.commands.serve import worker_argv
    from vllm_specdiff.plugin.config import parse_specdiff_config
    from vllm_specdiff.plugin.engine import specdiff_engine_args
    from vllm_specdiff.plugin.workers import CPU_CONDITIONED_WORKER, reads_verifier

    assert reads_verifier(conditioned_dir)  # reads_verifier(None): the default's kind (below)
    args = specdiff_engine_args(4, drafter=conditioned_dir)
    assert args["worker_cls"] == CPU_CONDITIONED_WORKER
    assert "async_scheduling" not in args  # nothing else changes for K = 1
    config = parse_specdiff_config({"specdiff": {"drafter": conditioned_dir}}, gamma=4)
    assert worker_argv(["m"], config) == ["m", "--worker-cls", CPU_CONDITIONED_WORKER]
    assert worker_argv(["m", "--worker-cls", "x.W"], config) == ["m", "--worker-cls", "x.W"]


def test_a_conditioned_drafter_with_k_drafts_selects_the_combined_worker(conditioned_dir):
    """num_drafts > 1 is accepted with a conditioned drafter and needs the worker that both
    verifies tries and captures the verifier's states, with the tree path's settings."""
    from vllm_specdiff.commands.serve import worker_argv
    from vllm_specdiff.plugin.config import parse_specdiff_config
    from vllm_specdiff.plugin.engine import specdiff_engine_args
    from vllm_specdiff.plugin.workers import CPU_CONDITIONED_TREE_WORKER

    section = {"drafter": conditioned_dir, "num_drafts": 2, "drafter_temperature": 1.0}
    config = parse_specdiff_config({"specdiff": section}, gamma=4)
    assert config.num_drafts == 2
    args = specdiff_engine_args(4, **section)
    assert args["worker_cls"] == CPU_CONDITIONED_TREE_WORKER
    assert args["async_scheduling"] is False
    assert "compilation_config" not in args  # CUDA graphs are a CUDA matter
    assert worker_argv(["m"], config) == ["m", "--worker-cls", CPU_CONDITIONED_TREE_WORKER,
                                          "--no-async-scheduling"]


def test_the_speculative_model_shorthand_adds_the_conditioned_worker(conditioned_dir,
                                                                    monkeypatch):
    """`--speculative-model DIR` with a conditioned drafter: serve's rewritten arguments and
    generate/bench's engine arguments name the proposer with that drafter and the worker that
    captures the verifier's states; the engine's model is the verifier the proposer reads
    (`load_drafter(verifier=model_config.model)`)."""
    import json

    import vllm

    from vllm_specdiff.cli import build_parser
    from vllm_specdiff.commands.common import build_llm, expand_speculative_model
    from vllm_specdiff.commands.serve import check_specdiff_args, worker_argv
    from vllm_specdiff.plugin.engine import PROPOSER_PATH
    from vllm_specdiff.plugin.workers import CPU_CONDITIONED_WORKER

    # serve: the steps `serve()` takes before vLLM parses the arguments
    argv = expand_speculative_model(["verifier", "--speculative-model", conditioned_dir,
                                     "--num-speculative-tokens", "4"])
    config = check_specdiff_args(argv)
    assert config is not None and config.drafter == conditioned_dir
    argv = worker_argv(argv, config)
    assert argv[0] == "verifier"
    assert argv[argv.index("--worker-cls") + 1] == CPU_CONDITIONED_WORKER
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "model": PROPOSER_PATH, "num_speculative_tokens": 4}
    assert json.loads(argv[argv.index("--additional-config") + 1]) == {
        "specdiff": {"drafter": conditioned_dir}}

    # generate and bench: the `LLM(...)` arguments build_llm passes (no engine starts)
    monkeypatch.setattr(vllm, "LLM", lambda **kwargs: kwargs)
    parser = build_parser()
    for command in (["generate", "--input", "i.jsonl", "--output", "o.jsonl"], ["bench"]):
        args = parser.parse_args([*command, "--model", "verifier", "--speculative-model",
                                  conditioned_dir, "--num-speculative-tokens", "4"])
        kwargs = build_llm(args, args.model, speculative=True)
        assert kwargs["model"] == "verifier"
        assert kwargs["worker_cls"] == CPU_CONDITIONED_WORKER
        assert kwargs["speculative_config"] == {"model": PROPOSER_PATH,
                                                "num_speculative_tokens": 4}
        assert kwargs["additional_config"]["specdiff"]["drafter"] == conditioned_dir
        assert "worker_cls" not in build_llm(args, args.model, speculative=False)


def test_committed_rows_keep_prefill_chunks_and_accepted_drafts_only():
    from vllm_specdiff.plugin.conditioned_runner import committed_rows

    # request 0: a prefill chunk of 5 (nothing sampled yet); 1: last prompt chunk of 3, one
    # token sampled; 2: a decode step with 4 drafts, 2 accepted (3 sampled); 3: all 4 rejected
    query_start = np.array([0, 5, 8, 13, 18])
    sampled = [[], [7], [1, 2, 3], [9]]
    assert committed_rows(query_start, sampled, [0, 0, 4, 4]) == [5, 3, 3, 1]
    assert committed_rows(query_start[:3], sampled[:2], None) == [5, 3]


@pytest.mark.parametrize("kind", ["standalone", "conditioned"])
def test_the_default_drafter_kind_decides_the_worker(kind, monkeypatch, tmp_path):
    """Without a `drafter` option the worker follows models.DEFAULT_DRAFTER_KIND: the conditioned
    default needs the feature-capturing worker, the standalone one vLLM's own (as before)."""
    from vllm_specdiff import models
    from vllm_specdiff.commands.serve import worker_argv
    from vllm_specdiff.plugin.config import parse_specdiff_config
    from vllm_specdiff.plugin.engine import specdiff_engine_args
    from vllm_specdiff.plugin.workers import CPU_CONDITIONED_WORKER, reads_verifier

    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(models.DRAFTER_ENV, raising=False)
    monkeypatch.setattr(models, "DEFAULT_DRAFTER_KIND", kind)
    conditioned = kind == "conditioned"
    assert reads_verifier(None) is conditioned
    args = specdiff_engine_args(4)
    assert (args.get("worker_cls") == CPU_CONDITIONED_WORKER) is conditioned
    assert conditioned or "worker_cls" not in args
    config = parse_specdiff_config({"specdiff": {}}, gamma=4)
    assert worker_argv(["m"], config) == \
        (["m", "--worker-cls", CPU_CONDITIONED_WORKER] if conditioned else ["m"])
