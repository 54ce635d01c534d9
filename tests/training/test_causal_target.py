"""`train --objective ar`: the autoregressive baseline drafter (vLLM's draft_model) on tiny models.

Its window logits are the teacher-forced logits of a plain causal LM, `mdm` on them is the
next-token cross-entropy, training lowers it, and `export` writes a transformers directory that
reproduces the trained module's logits.
"""

import json

import pytest
import torch

from vllm_specdiff_training.causal import CausalLMDrafter, load_causal_drafter
from vllm_specdiff_training.cli import main
from vllm_specdiff_training.data import load_sequences
from vllm_specdiff_training.evaluate import parse_candidate
from vllm_specdiff_training.export import ExportConfig, run_export
from vllm_specdiff_training.losses import Targets, greedy_accepted_of, mdm_loss
from vllm_specdiff_training.model import drafter_from_checkpoint
from vllm_specdiff_training.trainer import TrainConfig, run_train
from vllm_specdiff_training.windows import VocabMap, make_batch

from .conftest import make_verifier
from .test_pipeline import GAMMA, _generate


@pytest.fixture(scope="module")
def greedy_data(tmp_path_factory, verifier_dir, prompts_file):
    out = tmp_path_factory.mktemp("greedy")
    _generate(verifier_dir, prompts_file, out, temperature=0.0, num_samples=1)
    return out


@pytest.fixture(scope="module")
def tied_verifier(tmp_path_factory):
    """A verifier whose LM head is its embedding, as in the default verifier (SmolLM2)."""
    from transformers import LlamaForCausalLM

    path = make_verifier(tmp_path_factory.mktemp("tied"), seed=1, layers=3)
    model = LlamaForCausalLM.from_pretrained(str(path))
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(str(path))
    return path


def _ar_cfg(data, out, verifier, **kw):
    cfg = dict(data=str(data), output=str(out), init_from=str(verifier), num_layers=2,
               objective="ar", finetune="full", loss="mdm", gamma=GAMMA, steps=12, batch_size=4,
               windows_per_seq=4, lr=1e-2, warmup_steps=1, schedule="constant",
               heldout_fraction=0.25, save_every=6, eval_every=6, eval_windows=16,
               freeze_params=["embed_tokens", r"layers\.0\.", "lm_head"])
    cfg.update(kw)
    return TrainConfig(**cfg)


def test_window_logits_are_teacher_forced_and_mdm_is_their_next_token_ce(greedy_data,
                                                                         verifier_dir):
    data = load_sequences(greedy_data)
    drafter = load_causal_drafter(verifier_dir, num_layers=1)
    assert drafter.num_layers == 1 and len(drafter.lm.model.layers) == 1
    seqs = [0, 1]
    starts = [[int(data.prompt_lens[i]), int(data.prompt_lens[i]) + 2] for i in seqs]
    batch = make_batch(data, seqs, starts, GAMMA, lookahead=GAMMA - 1)
    with torch.no_grad():
        logits = drafter.window_logits(batch.input_ids, batch.starts, GAMMA)  # [B, M, G, V]
        for row, i in enumerate(seqs):
            full = drafter.lm(data.sequence(i)[None]).logits[0]  # plain causal LM, whole sequence
            for col, s in enumerate(starts[row]):
                torch.testing.assert_close(logits[row, col], full[s - 1:s - 1 + GAMMA])
    # mdm on AR logits = next-token cross-entropy, computed here by hand in float64
    flat = logits[batch.valid]
    targets = batch.targets(VocabMap(drafter.vocab_size))
    expected = []
    for w in range(flat.shape[0]):
        lp = flat[w].double().log_softmax(-1)
        expected.append(-sum(lp[j, targets.tokens[w, j]] for j in range(GAMMA)) / GAMMA)
    torch.testing.assert_close(mdm_loss(flat, targets).double(), torch.stack(expected))
    # Without the targets' prefixes in the batch the windows cannot be computed: refused.
    short = make_batch(data, seqs, starts, GAMMA)
    with pytest.raises(ValueError, match="lookahead"):
        drafter.window_logits(short.input_ids, short.starts, GAMMA)


def test_greedy_accepted_length_counts_leading_argmax_matches():
    logits = torch.full((3, 4, 5), -1.0)
    for w, argmax in enumerate(([1, 2, 3, 4], [1, 2, 3, 4], [0, 0, 0, 0])):
        logits[w, torch.arange(4), torch.tensor(argmax)] = 1.0
    tokens = torch.tensor([[1, 2, 3, 4], [1, 0, 3, 4], [-1, 0, 0, 0]])
    assert greedy_accepted_of(logits, Targets(tokens)).tolist() == [4, 1, 0]


def test_ar_training_lowers_the_loss_and_exports_a_transformers_model(tmp_path, greedy_data,
                                                                      tied_verifier):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "ar"
    summary = run_train(_ar_cfg(greedy_data, run, tied_verifier))
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert log[0]["step"] == 0 and log[0]["loss"] is None  # the untrained drafter's measure
    losses = [r["loss"] for r in log[1:]]
    assert sum(losses[-3:]) / 3 < 0.95 * sum(losses[:3]) / 3, losses
    assert summary["objective"] == "ar" and summary["heldout_greedy_accepted_length"] is not None
    measured = [r for r in log if "heldout_expected_streak" in r]
    assert [r["step"] for r in measured] == [0, 6, 12]
    assert all(0 <= r["heldout_greedy_accepted_length"] <= GAMMA for r in measured)
    assert all(r["tokens"] > 0 and r["cpu_seconds"] > 0 for r in log[1:])

    out = tmp_path / "export"
    result = main(["export", "--run", str(run), "--verifier", str(tied_verifier),
                   "--output", str(out)])
    assert result == 0
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert (out / "tokenizer.json").is_file() and (out / "learning_curve.json").is_file()
    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    trained = drafter_from_checkpoint(run / "checkpoints" / "step-0000012")
    untrained = load_causal_drafter(tied_verifier, num_layers=2)
    ids = load_sequences(greedy_data).sequence(3)[None]
    with torch.no_grad():
        got = exported(ids).logits
        torch.testing.assert_close(got, trained.lm(ids).logits)
        assert (got - untrained.lm(ids).logits).abs().max() > 1e-2  # the trained weights shipped
        # frozen parts are the verifier's: embedding (= tied head) and layer 0
        torch.testing.assert_close(exported.model.embed_tokens.weight,
                                   untrained.lm.model.embed_tokens.weight)
        torch.testing.assert_close(exported.model.layers[0].mlp.down_proj.weight,
                                   untrained.lm.model.layers[0].mlp.down_proj.weight)
    # the run's own model/ directory is the same model
    assert json.loads((run / "model" / "config.json").read_text())["num_hidden_layers"] == 2
    with pytest.raises(ValueError, match="full head"):
        run_export(ExportConfig(run=str(run), verifier=str(tied_verifier),
                                output=str(tmp_path / "x"), draft_vocab_size=16))
    with pytest.raises(ValueError, match="autoregressive"):
        parse_candidate(str(run))


def test_ar_resumes_and_old_runs_without_objective_still_resume(tmp_path, greedy_data,
                                                                 verifier_dir):
    run = tmp_path / "r"
    run_train(_ar_cfg(greedy_data, run, verifier_dir, steps=2, save_every=2, eval_every=0,
                      objective="diffusion"))
    state_file = run / "checkpoints" / "step-0000002" / "state.json"
    state = json.loads(state_file.read_text())
    del state["config"]["objective"]  # a run saved before --objective existed
    state_file.write_text(json.dumps(state))
    assert run_train(_ar_cfg(greedy_data, run, verifier_dir, steps=3, save_every=2,
                             eval_every=0, objective="diffusion"))["steps"] == 3
    with pytest.raises(ValueError, match="objective"):
        run_train(_ar_cfg(greedy_data, run, verifier_dir, steps=4, save_every=2, eval_every=0))


def test_ar_trains_on_soft_targets_with_kl(tmp_path, greedy_data, verifier_dir):
    import math

    summary = run_train(_ar_cfg(greedy_data, tmp_path / "kl", verifier_dir, loss="kl", steps=2,
                                eval_every=0))
    log = [json.loads(line) for line in (tmp_path / "kl" / "log.jsonl").read_text().splitlines()]
    assert summary["steps"] == 2 and all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in log)


def test_ar_step_counts_the_causal_pass_tokens_only(tmp_path, greedy_data, verifier_dir):
    from vllm_specdiff_training.trainer import Trainer

    trainer = Trainer(_ar_cfg(greedy_data, tmp_path / "t", verifier_dir))
    batch = trainer._micro_batch(0)
    assert batch.input_ids.shape[1] == int(batch.starts.max()) + GAMMA - 1  # targets' prefixes
    assert trainer.train_step()["tokens"] == batch.input_ids.numel()  # no mask block is run


@pytest.mark.parametrize(("kw", "match"), [
    ({"objective": "mlm"}, "--objective must be"),
    ({"finetune": "lora"}, "--finetune full"),
    ({"draft_vocab_size": 16}, "--draft-vocab-size"),
    ({"init_lora": "x"}, "--init-lora"),
])
def test_ar_refuses_settings_it_cannot_honour(tmp_path, greedy_data, verifier_dir, kw, match):
    with pytest.raises(ValueError, match=match):
        _ar_cfg(greedy_data, tmp_path / "bad", verifier_dir, **kw).validate()


def test_ar_drafter_from_a_directory_keeps_all_its_layers(tmp_path, verifier_dir):
    drafter = load_causal_drafter(verifier_dir)
    assert isinstance(drafter, CausalLMDrafter) and drafter.num_layers == 2
    with pytest.raises(ValueError, match="num-layers"):
        load_causal_drafter(verifier_dir, num_layers=3)
