"""generate -> train -> eval on tiny models: shards, resume, adapters, tokenizer checks, the CLI."""

import json
import shutil

import pytest
import torch

from vllm_specdiff.drafter.loading import load_drafter
from vllm_specdiff_training.cli import main
from vllm_specdiff_training.data import load_sequences, shard_path, split_heldout
from vllm_specdiff_training.generate import GenerateConfig, run_generate
from vllm_specdiff_training.trainer import TrainConfig, run_train
from vllm_specdiff_training.windows import VocabMap, batch_generator, sample_batch

from .conftest import make_tokenizer, make_verifier

GAMMA = 4


def _generate(verifier, prompts, out, **kw):
    cfg = dict(verifier=str(verifier), prompts=str(prompts), output=str(out), num_samples=2,
               max_new_tokens=24, top_logprobs=4, chunk_size=8, batch_size=8,
               backend="transformers", chat_template=False)
    cfg.update(kw)
    return run_generate(GenerateConfig(**cfg))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, verifier_dir, prompts_file):
    out = tmp_path_factory.mktemp("data")
    _generate(verifier_dir, prompts_file, out)
    return out


def _train_cfg(data, out, verifier, **kw):
    cfg = dict(data=str(data), output=str(out), init_from=str(verifier), num_layers=1,
               gamma=GAMMA, steps=4, batch_size=3, windows_per_seq=3, lr=5e-3, warmup_steps=1,
               heldout_fraction=0.25, save_every=2, lora_rank=4, eval_windows=16)
    cfg.update(kw)
    return TrainConfig(**cfg)


def test_generate_writes_resumable_shards_with_soft_targets(tmp_path, verifier_dir, prompts_file,
                                                            data_dir):
    data = load_sequences(data_dir)
    assert len(data) == 24 * 2 and data.meta["num_prompts"] == 24
    assert sorted(p.name for p in data_dir.glob("shard-*")) == [
        "shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"]
    for i in range(len(data)):
        gen_len = data.length(i) - int(data.prompt_lens[i])
        assert 1 <= gen_len <= 24
        ids, lps = data.soft_targets(i)
        assert ids.shape == lps.shape == (gen_len, 4)
        assert (lps[:, :-1] >= lps[:, 1:]).all() and (lps <= 0).all()
    # The prompt boundary is stored: the prompt part is the prompt's tokens.
    assert data.sequence(0)[:int(data.prompt_lens[0])].tolist() == [
        3 + int(w[1:]) for w in json.loads(prompts_file.read_text().splitlines()[0]).split()]

    # Resume: a missing shard is regenerated identically (chunks are seeded by their index);
    # existing shards are skipped.
    copy = tmp_path / "copy"
    shutil.copytree(data_dir, copy)
    before = shard_path(copy, 1).read_bytes()
    shard_path(copy, 1).unlink()
    summary = _generate(verifier_dir, prompts_file, copy)
    assert summary["skipped"] == 2 and summary["generated_tokens"] > 0
    assert shard_path(copy, 1).read_bytes() == before
    with pytest.raises(ValueError, match="other settings.*max_new_tokens"):
        _generate(verifier_dir, prompts_file, copy, max_new_tokens=5)
    with pytest.raises(ValueError, match="greedy"):
        _generate(verifier_dir, prompts_file, tmp_path / "g", temperature=0.0, num_samples=2)


def test_greedy_data_windows_align_targets_and_soft_targets(tmp_path, verifier_dir, prompts_file):
    out = tmp_path / "greedy"
    _generate(verifier_dir, prompts_file, out, temperature=0.0, num_samples=1, max_prompts=8)
    data = load_sequences(out)
    eligible = list(range(len(data)))
    batch = sample_batch(data, eligible, 4, 3, GAMMA, batch_generator(0, 0), soft=True)
    # Greedy continuation: each target token is the verifier's top-1 at that position.
    assert torch.equal(batch.tokens[batch.valid], batch.topk_ids[batch.valid][..., 0])
    for row in range(batch.starts.shape[0]):
        for col in range(batch.starts.shape[1]):
            s = int(batch.starts[row, col])
            assert torch.equal(batch.input_ids[row, s:s + GAMMA], batch.tokens[row, col]) or \
                s + GAMMA > batch.input_ids.shape[1]
    # Windows never start inside the prompt.
    seq_of = [next(i for i in eligible if torch.equal(data.sequence(i)[:3], batch.input_ids[r, :3]))
              for r in range(batch.starts.shape[0])]
    for r, i in enumerate(seq_of):
        assert int(batch.starts[r].min()) >= int(data.prompt_lens[i])
    # Batches are a pure function of (seed, step): the basis of exact resume.
    again = sample_batch(data, eligible, 4, 3, GAMMA, batch_generator(0, 0), soft=True)
    assert torch.equal(again.starts, batch.starts) and torch.equal(again.tokens, batch.tokens)


def test_heldout_split_is_by_prompt_and_deterministic(data_dir):
    data = load_sequences(data_dir)
    train, held = split_heldout(data, 0.25)
    assert len(train) + len(held) == len(data) and len(held) > 0
    assert not set(train.prompt_index.tolist()) & set(held.prompt_index.tolist())
    again = split_heldout(data, 0.25)[1]
    assert torch.equal(again.prompt_index, held.prompt_index)


def test_train_and_eval_hold_out_the_same_prompts_whatever_their_seeds(tmp_path, data_dir,
                                                                         verifier_dir):
    from vllm_specdiff_training.evaluate import EvalConfig, Evaluator

    trainer_held = split_heldout(load_sequences(data_dir), 0.25)[1]
    cfg = EvalConfig(data=str(data_dir), verifier=str(verifier_dir), gamma=GAMMA,
                     candidates=[str(verifier_dir)], output=str(tmp_path / "eval.json"),
                     heldout_fraction=0.25, seed=7)
    assert torch.equal(Evaluator(cfg).data.prompt_index, trainer_held.prompt_index)


def test_resume_continues_with_bit_identical_losses(tmp_path, data_dir, verifier_dir):
    full = run_train(_train_cfg(data_dir, tmp_path / "full", verifier_dir, lora_dropout=0.2,
                                grad_accum=2))
    full_log = [json.loads(x) for x in (tmp_path / "full" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in full_log] == [1, 2, 3, 4]
    # A run interrupted after step 2: only its step-2 checkpoint survives.
    part = tmp_path / "part"
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step-0000002",
                    part / "checkpoints" / "step-0000002")
    # it had logged step 3 before dying; resuming from step 2 must not log step 3 twice
    (part / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in full_log[:3]))
    resumed = run_train(_train_cfg(data_dir, part, verifier_dir, lora_dropout=0.2, grad_accum=2))
    part_log = [json.loads(x) for x in (part / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in part_log] == [1, 2, 3, 4]
    part_log = part_log[2:]
    for a, b in zip(full_log[2:], part_log, strict=True):
        assert a["loss"] == b["loss"] and a["expected_streak"] == b["expected_streak"]
    assert full["heldout_expected_streak"] == resumed["heldout_expected_streak"]
    # Resuming with other settings, or starting over on top of checkpoints, is refused.
    with pytest.raises(ValueError, match="--loss differ"):
        run_train(_train_cfg(data_dir, part, verifier_dir, lora_dropout=0.2, grad_accum=2,
                             loss="mdm"))
    with pytest.raises(ValueError, match="earlier run"):
        run_train(_train_cfg(data_dir, part, verifier_dir, resume=False))


def test_several_data_directories_load_as_one_with_their_own_prompt_numbers(
        tmp_path, data_dir, verifier_dir, prompts_file):
    from vllm_specdiff_training.data import PROMPT_INDEX_STRIDE

    more = tmp_path / "more"
    _generate(verifier_dir, prompts_file, more, num_samples=1, max_new_tokens=16)
    one, two = load_sequences(data_dir), load_sequences(more)
    both = load_sequences(f"{data_dir},{more}")
    assert len(both) == len(one) + len(two)
    assert torch.equal(both.sequence(len(one)), two.sequence(0))
    assert torch.equal(both.prompt_index[:len(one)], one.prompt_index.long())
    assert torch.equal(both.prompt_index[len(one):], two.prompt_index.long() + PROMPT_INDEX_STRIDE)
    assert torch.equal(both.soft_targets(len(one))[0], two.soft_targets(0)[0])
    # appending a directory leaves the first one's held-out prompts as they were
    held_one = split_heldout(one, 0.25)[1].prompt_index
    held_both = split_heldout(both, 0.25)[1].prompt_index
    assert torch.equal(held_both[held_both < PROMPT_INDEX_STRIDE], held_one.long())
    other = tmp_path / "other"
    _generate(verifier_dir, prompts_file, other, top_logprobs=0, max_new_tokens=8)
    with pytest.raises(ValueError, match="top_logprobs differs"):
        load_sequences(f"{data_dir},{other}")


def test_a_resumed_run_may_append_data_but_not_swap_it(tmp_path, data_dir, verifier_dir,
                                                       prompts_file):
    more = tmp_path / "more"
    _generate(verifier_dir, prompts_file, more, num_samples=1, max_new_tokens=16)
    run_train(_train_cfg(data_dir, tmp_path / "run", verifier_dir, steps=2))
    with pytest.raises(ValueError, match="--data differ"):
        run_train(_train_cfg(more, tmp_path / "run", verifier_dir, steps=4))
    with pytest.raises(ValueError, match="--data differ"):
        run_train(_train_cfg(f"{more},{data_dir}", tmp_path / "run", verifier_dir, steps=4))
    summary = run_train(_train_cfg(f"{data_dir},{more}", tmp_path / "run", verifier_dir,
                                   steps=4))
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4] and summary["steps"] == 4


@pytest.mark.vllm
def test_adapter_loads_through_lora_option_and_changes_marginals(tmp_path, data_dir, verifier_dir):
    from vllm_specdiff_training.trainer import Trainer

    trainer = Trainer(_train_cfg(data_dir, tmp_path / "run", verifier_dir, steps=6, lr=2e-2))
    summary = trainer.run()
    base = load_drafter(summary["base"])
    tuned = load_drafter(summary["base"], lora=summary["adapter"])
    ctx = [load_sequences(data_dir).sequence(0)[:6], load_sequences(data_dir).sequence(3)[:9]]
    q_base = base.draft_logits(ctx, GAMMA).softmax(-1)
    q_tuned = tuned.draft_logits(ctx, GAMMA).softmax(-1)
    assert (q_base - q_tuned).abs().max() > 1e-3
    # The same through the proposer's option: --additional-config '{"specdiff": {"lora": ...}}'.
    proposer = _proposer(summary["base"], summary["adapter"], verifier_dir)
    proposer.load_model(None)
    torch.testing.assert_close(proposer.drafter.draft_logits(ctx, GAMMA).softmax(-1), q_tuned)
    # The merged adapter reproduces the trained (unmerged, peft) drafter exactly.
    trainer.drafter.eval()
    with torch.no_grad():
        live = trainer.drafter.to_verifier_vocab(
            trainer.drafter.window_logits(ctx[1][None], torch.tensor([[9]]), GAMMA))[0, 0]
    torch.testing.assert_close(tuned.draft_logits([ctx[1]], GAMMA)[0], live, rtol=1e-4, atol=1e-4)


def _proposer(drafter, lora, verifier):
    """SpecDiffProposer as vLLM constructs it, with only the config fields it reads."""
    from types import SimpleNamespace

    from vllm_specdiff.plugin.proposer import SpecDiffProposer

    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=GAMMA),
        # float32: the merged adapter must reproduce the trained drafter's marginals exactly
        # (int8, the CPU default, only approximates them)
        additional_config={"specdiff": {"drafter": str(drafter), "lora": str(lora),
                                        "quantize": "none"}},
        model_config=SimpleNamespace(  # the fields vLLM's tokenizer loader reads, too
            model=str(verifier), max_model_len=256, get_vocab_size=lambda: 64,
            tokenizer=str(verifier), skip_tokenizer_init=False, runner_type="generate",
            tokenizer_mode="auto", tokenizer_revision=None, trust_remote_code=False),
        scheduler_config=SimpleNamespace(max_num_seqs=4))
    return SpecDiffProposer(cfg)


def test_full_finetune_with_reduced_vocab_and_checkpointing(tmp_path, data_dir, verifier_dir):
    from vllm_specdiff.drafter.vocab import build_d2t, count_tokens, save_d2t

    data = load_sequences(data_dir)
    d2t = build_d2t(count_tokens([data.tokens.tolist()], 64), 40, always_include=[1])
    table = save_d2t(tmp_path / "d2t.safetensors", d2t)
    summary = run_train(_train_cfg(data_dir, tmp_path / "full", verifier_dir, finetune="full",
                                   draft_vocab=str(table), gradient_checkpointing=True,
                                   loss="streak-soft", freeze_params=["embed_tokens", "lm_head"]))
    assert "model" in summary and summary["trainable_parameters"] > 0
    drafter = load_drafter(summary["model"])
    assert drafter.draft_vocab_size == 40 and torch.equal(drafter.draft_to_verifier, d2t)
    vocab = VocabMap(64, d2t)
    assert 0 < vocab.coverage(data.tokens) < 1
    logits = drafter.draft_logits([data.sequence(0)[:5]], GAMMA)
    uncovered = torch.ones(64, dtype=torch.bool)
    uncovered[d2t] = False
    assert torch.isinf(logits[0][:, uncovered]).all()


def test_data_from_another_tokenizer_is_refused(tmp_path, data_dir, verifier_dir, prompts_file):
    other = tmp_path / "other"
    make_verifier(other, seed=1)
    make_tokenizer(other, seed_word="x")  # same size, different token -> id map
    with pytest.raises(ValueError, match="fingerprint"):
        run_train(_train_cfg(data_dir, tmp_path / "run", other))
    assert main(["eval", "--data", str(data_dir), "--verifier", str(other), "--candidate",
                 str(verifier_dir), "--output", str(tmp_path / "e.json")]) == 2


def test_cli_end_to_end(tmp_path, verifier_dir, prompts_file, capsys):
    data, run = tmp_path / "data", tmp_path / "run"
    assert main(["generate", "--verifier", str(verifier_dir), "--prompts", str(prompts_file),
                 "--output", str(data), "--num-samples", "2", "--max-new-tokens", "20",
                 "--top-logprobs", "3", "--backend", "transformers", "--no-chat-template"]) == 0
    assert main(["train", "--data", str(data), "--output", str(run), "--init-from",
                 str(verifier_dir), "--num-layers", "1", "--gamma", "4", "--steps", "3",
                 "--batch-size", "2", "--loss", "kl", "--lora-targets", "q_proj,v_proj",
                 "--heldout-fraction", "0.25"]) == 0
    out = tmp_path / "eval" / "eval.json"
    capsys.readouterr()
    assert main(["eval", "--data", str(data), "--verifier", str(verifier_dir), "--gamma", "4",
                 "--candidate", f"base={run}/base", "--candidate", f"kl={run}",
                 "--candidate", f"ckpt={run}/checkpoints/step-0000003",
                 "--num-drafts", "2", "--output", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"base", "kl", "ckpt"} == set(printed["results"])
    # The last checkpoint (unmerged LoRA) and the saved adapter (merged at load) agree.
    res = report["results"]
    assert abs(res["ckpt"]["verifier_token_streak"] - res["kl"]["verifier_token_streak"]) < 1e-4
    assert res["ckpt"]["greedy_accepted_length"] == res["kl"]["greedy_accepted_length"]
    assert report["settings"]["heldout_fraction"] == 0.25  # taken from the train run
    for r in report["results"].values():
        assert 0 <= r["greedy_accepted_length"] <= 4 and 0 <= r["expected_accepted_length"] <= 4
        assert r["expected_accepted_length_selected"] >= r["expected_accepted_length"] - 1e-6
        assert len(r["per_position_acceptance_expected"]) == 4
    assert out.with_suffix(".png").stat().st_size > 1000
    assert (run / "adapter" / "eval_results.json").is_file()
    cfg = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert sorted(cfg["target_modules"]) == ["q_proj", "v_proj"] and cfg["r"] == 16
    # Bad input: a clear message naming the option, exit code 2.
    assert main(["train", "--data", str(tmp_path / "nope"), "--output", str(run),
                 "--init-from", str(verifier_dir)]) == 2
    assert "--data" in capsys.readouterr().err


def test_vllm_logprobs_keep_the_k_most_likely():
    # vLLM returns the top-k plus the sampled token when it is not among them.
    from dataclasses import dataclass

    from vllm_specdiff_training.generate import _vllm_topk

    @dataclass
    class Lp:
        logprob: float

    positions = [{5: Lp(-0.1), 9: Lp(-3.0), 2: Lp(-2.5)}, {7: Lp(-0.5), 1: Lp(-1.0)}]
    ids, lps = _vllm_topk(positions, 2, 2)
    assert ids.tolist() == [[5, 2], [7, 1]]
    torch.testing.assert_close(lps, torch.tensor([[-0.1, -2.5], [-0.5, -1.0]]))


def test_eval_scores_a_drafter_that_is_the_verifier_on_position_one(tmp_path, data_dir,
                                                                    verifier_dir):
    # All verifier layers: the block-causal drafter's first draft token is the verifier's own
    # prediction, so greedy position 1 is always accepted and sampled position 1 is accepted with
    # probability sum_x p(x)^2 (drafts sampled from q_1 = p at T_d = 1).
    from vllm_specdiff.drafter.block_causal import BlockCausalDrafter
    from vllm_specdiff_training.evaluate import EvalConfig, run_eval

    BlockCausalDrafter.from_causal_lm(verifier_dir, 2).save_pretrained(tmp_path / "full")
    report = run_eval(EvalConfig(data=str(data_dir), verifier=str(verifier_dir),
                                 candidates=[f"same={tmp_path / 'full'}"], gamma=GAMMA,
                                 num_drafts=4, split="all", max_windows=64, plot=False,
                                 output=str(tmp_path / "e.json")))
    r = report["results"]["same"]
    assert r["per_position_acceptance_greedy"][0] == 1.0
    assert r["greedy_accepted_length"] >= 1.0
    from transformers import AutoModelForCausalLM

    from vllm_specdiff_training.windows import eval_windows

    data = load_sequences(data_dir)
    verifier = AutoModelForCausalLM.from_pretrained(verifier_dir).eval()
    exact = []
    for i, starts in eval_windows(data, GAMMA, 4, 64):
        with torch.no_grad():
            probs = verifier(data.sequence(i)[None, :max(starts)]).logits[0].softmax(-1)
        exact += [float((probs[s - 1] ** 2).sum()) for s in starts]
    assert r["windows"] == len(exact)
    assert abs(r["per_position_acceptance_expected"][0] - sum(exact) / len(exact)) < 0.05
    # per-window figures (K = 4 drafts averaged per window) whose means are the reported ones
    taus, greedy = r["expected_accepted_length_per_window"], r["greedy_accepted_length_per_window"]
    assert len(taus) == len(greedy) == len(exact)
    assert abs(sum(taus) / len(taus) - r["expected_accepted_length"]) < 1e-4
    assert sum(greedy) / len(greedy) == pytest.approx(r["greedy_accepted_length"])
    assert all(g >= 1 for g in greedy)  # position 1 is the verifier's own argmax


def test_training_imports_without_vllm():
    import subprocess
    import sys

    code = ("import sys, vllm_specdiff_training.cli, vllm_specdiff_training.generate, "
            "vllm_specdiff_training.trainer, vllm_specdiff_training.evaluate; "
            "vllm_specdiff_training.cli.build_parser(); "
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_transformers_backend_samples_from_p_not_the_models_generation_config(
        tmp_path, verifier_dir, prompts_file):
    """A verifier shipping top_k=1 in generation_config.json must not turn x ~ P into greedy."""
    verifier = tmp_path / "verifier"
    shutil.copytree(verifier_dir, verifier)
    (verifier / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "top_k": 1, "repetition_penalty": 1.5}))
    _generate(verifier, prompts_file, tmp_path / "data", num_samples=16, max_new_tokens=1,
              top_logprobs=0, max_prompts=2)
    data = load_sequences(tmp_path / "data")
    firsts: dict[int, set[int]] = {}
    for i in range(len(data)):
        seq = data.sequence(i)
        firsts.setdefault(int(data.prompt_index[i]), set()).add(int(seq[data.prompt_lens[i]]))
    assert max(len(tokens) for tokens in firsts.values()) > 1


def test_eval_without_the_verifier_pass_scores_against_the_datas_tokens(tmp_path, verifier_dir,
                                                                        prompts_file):
    # On greedy data the verifier's argmax along the data is the data's next token, so the greedy
    # draft's leading matches with the data (no verifier pass) are its accepted length against
    # the verifier, window by window; --no-verifier-pass gives the same data figures, and None
    # for what needs the verifier.
    from vllm_specdiff.drafter.block_causal import BlockCausalDrafter
    from vllm_specdiff_training.evaluate import EvalConfig, run_eval

    data = tmp_path / "greedy"
    _generate(verifier_dir, prompts_file, data, temperature=0.0, num_samples=1, max_prompts=8)
    BlockCausalDrafter.from_causal_lm(verifier_dir, 1).save_pretrained(tmp_path / "d")

    def scores(verifier_pass: bool) -> dict:
        return run_eval(EvalConfig(data=str(data), verifier=str(verifier_dir),
                                   candidates=[f"d={tmp_path / 'd'}"], gamma=GAMMA, split="all",
                                   max_windows=24, plot=True, verifier_pass=verifier_pass,
                                   output=str(tmp_path / f"{verifier_pass}.json")))["results"]["d"]

    full, cheap = scores(True), scores(False)
    assert full["data_greedy_accepted_length_per_window"] == \
        full["greedy_accepted_length_per_window"]
    assert 0 < full["data_greedy_accepted_length"] < GAMMA  # neither trivially 0 nor all
    for key in ("verifier_token_streak", "data_greedy_accepted_length",
                "data_greedy_accepted_length_per_window", "per_position_acceptance_data_greedy"):
        assert cheap[key] == full[key], key
    assert cheap["expected_accepted_length"] is None and cheap["greedy_accepted_length"] is None
    assert cheap["windows"] == full["windows"] == 24
    assert (tmp_path / "False.png").is_file()


def test_datastore_command_holds_the_training_split_only(tmp_path, data_dir, capsys):
    from vllm_specdiff.core.datastore import Datastore

    out = tmp_path / "store" / "datastore.safetensors"
    assert main(["datastore", "--data", str(data_dir), "--output", str(out),
                 "--heldout-fraction", "0.25"]) == 0
    summary = json.loads(capsys.readouterr().out)
    train, held = split_heldout(load_sequences(data_dir), 0.25)
    assert summary["sequences"] == len(train) and summary["held_out_sequences"] == len(held) > 0
    generated = [train.sequence(i)[int(train.prompt_lens[i]):] for i in range(len(train))]
    store = Datastore.load(out)
    assert len(store) == summary["continuation_tokens"] == sum(len(g) for g in generated)
    # a training continuation is drafted from its own prompt's end onwards
    seq, plen = train.sequence(0).numpy(), int(train.prompt_lens[0])
    draft = store.draft(seq[: plen + 4], 3)
    assert draft is not None and len(draft) >= 1
    assert main(["datastore", "--data", str(tmp_path / "none"), "--output", str(out)]) == 2
