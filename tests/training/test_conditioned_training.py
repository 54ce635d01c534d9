"""Training verifier-conditioned drafters: their losses, resume and checkpoints."""

import json

import pytest
import torch

from vllm_specdiff_training.model import drafter_from_checkpoint
from vllm_specdiff_training.trainer import TrainConfig, Trainer, latest_checkpoint

GAMMA = 4


def _cfg(data, out, init_from, **kw):
    cfg = dict(data=str(data), output=str(out), init_from=init_from and str(init_from),
               arch="conditioned",
               num_layers=1, num_taps=2, gamma=GAMMA, steps=6, batch_size=3, windows_per_seq=3,
               lr=3e-3, warmup_steps=1, heldout_fraction=0.25, save_every=3, eval_every=3,
               eval_windows=16, finetune="full", loss="ce-decay", schedule="constant")
    cfg.update(kw)
    return TrainConfig(**cfg)


def test_conditioned_run_learns_resumes_and_rebuilds_from_its_checkpoint(tmp_path, greedy_data,
                                                                         verifier3):
    long = Trainer(_cfg(greedy_data, tmp_path / "long", verifier3, steps=60, lr=1e-2))
    first = long.heldout_measures()["heldout_expected_streak"]
    summary = long.run()
    # it learns the verifier's streaks (0.02 -> 0.07 on this tiny random verifier)
    assert summary["heldout_expected_streak"] > 2.5 * first
    assert summary["trainable_parameters"] < sum(p.numel() for p in long.drafter.parameters())

    # eval scores the saved directory and the run's checkpoint alike, with the verifier pass
    from vllm_specdiff_training.evaluate import EvalConfig, run_eval

    report = run_eval(EvalConfig(
        data=str(greedy_data), verifier=str(verifier3), gamma=GAMMA, max_windows=24,
        candidates=[f"dir={summary['model']}", f"run={tmp_path / 'long'}"],
        output=str(tmp_path / "eval.json"), heldout_fraction=0.25, replay=True))["results"]
    assert report["dir"]["expected_accepted_length"] == pytest.approx(
        report["run"]["expected_accepted_length"], rel=1e-5)
    assert report["dir"]["greedy_accepted_length"] > 0
    replayed = report["dir"]  # serving order, with the drafter's features
    assert sum(replayed["replay_histogram"]) == replayed["replay_steps"] > 0
    assert replayed["replay_accepted_per_step"] == pytest.approx(
        report["run"]["replay_accepted_per_step"], rel=1e-5)
    assert len(report["dir"]["per_position_acceptance_greedy"]) == GAMMA

    # the curve starts at the untrained drafter (step 0) and lands in one JSON with its machine
    from vllm_specdiff_training.curves import CurvesConfig, run_curves

    curves = run_curves(CurvesConfig(runs=[str(tmp_path / "long")],
                                     output=str(tmp_path / "curves.json")))
    saved = json.loads((tmp_path / "curves.json").read_text())
    steps = [p["step"] for p in saved["runs"]["long"]["curve"]]
    assert steps[0] == 0 and steps[-1] == 60 and "machine" in saved["provenance"]
    assert curves["last"]["long"]["heldout_expected_streak"] == pytest.approx(
        summary["heldout_expected_streak"])

    # export ships the trained tensors in float16, with the run's curve
    from vllm_specdiff.drafter.conditioned import ConditionedDrafter
    from vllm_specdiff_training.export import ExportConfig, run_export

    shipped = run_export(ExportConfig(run=str(tmp_path / "long"), verifier=str(verifier3),
                                      output=str(tmp_path / "shipped")))
    assert shipped["step"] == 60 and (tmp_path / "shipped" / "learning_curve.json").is_file()
    again = ConditionedDrafter.from_pretrained(tmp_path / "shipped", verifier3).eval()
    batch = long._micro_batch(0)
    with torch.no_grad():
        torch.testing.assert_close(
            again.window_logits(batch.input_ids, batch.starts, GAMMA, batch.features),
            long.drafter.eval().window_logits(batch.input_ids, batch.starts, GAMMA,
                                              batch.features), rtol=0.02, atol=0.05)

    # a later stage starts from the shipped drafter (a new machine keeps only the repository)
    more = Trainer(_cfg(greedy_data, tmp_path / "more", verifier3, steps=62,
                        drafter=str(tmp_path / "shipped")))
    assert more.heldout_measures()["heldout_expected_streak"] == pytest.approx(
        summary["heldout_expected_streak"], abs=0.02)
    with pytest.raises(ValueError, match="keeps that drafter's head"):
        _cfg(greedy_data, tmp_path, verifier3, drafter=str(tmp_path / "shipped"),
             draft_vocab_size=8).validate()

    # stopped at step 3 and resumed: the same weights as a run that never stopped
    Trainer(_cfg(greedy_data, tmp_path / "r", verifier3, steps=3)).run()
    resumed = Trainer(_cfg(greedy_data, tmp_path / "r", verifier3))
    resumed.run()
    straight = Trainer(_cfg(greedy_data, tmp_path / "s", verifier3))
    straight.run()
    for (name, a), b in zip(resumed.drafter.named_parameters(),
                            straight.drafter.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")

    rebuilt = drafter_from_checkpoint(latest_checkpoint(tmp_path / "s"))
    batch = straight._micro_batch(0)
    with torch.no_grad():
        torch.testing.assert_close(
            rebuilt.window_logits(batch.input_ids, batch.starts, GAMMA, batch.features),
            straight.drafter.eval().window_logits(batch.input_ids, batch.starts, GAMMA,
                                                  batch.features))


def test_lora_adapts_a_trained_conditioned_drafter_and_loads_eval_and_exports_merged(
        tmp_path, greedy_data, verifier3):
    """`--finetune lora` on a trained conditioned drafter (`--drafter`): a PEFT adapter of its
    layers and fc that `load_drafter(lora=)` merges to the trained (unmerged) model's logits,
    that `eval` scores as the run's checkpoint, and that `export` ships merged."""
    from vllm_specdiff.drafter import load_drafter
    from vllm_specdiff.drafter.conditioned import ConditionedDrafter
    from vllm_specdiff_training.evaluate import EvalConfig, run_eval
    from vllm_specdiff_training.export import ExportConfig, run_export

    with pytest.raises(ValueError, match="--finetune lora adapts a trained conditioned drafter"):
        _cfg(greedy_data, tmp_path, verifier3, finetune="lora").validate()  # new layers
    base = Trainer(_cfg(greedy_data, tmp_path / "full", verifier3, steps=3)).run()["model"]
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "fc"]
    trainer = Trainer(_cfg(greedy_data, tmp_path / "lora", verifier3, drafter=base,
                           finetune="lora", lora_rank=4, lora_alpha=8.0, lora_targets=targets,
                           steps=4, save_every=4, lr=1e-2))
    trained = [n for n, p in trainer.drafter.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    assert any(n.startswith("fc.") for n in trained)
    summary = trainer.run()
    assert summary["base"] == base and "model" not in summary

    merged = load_drafter(base, lora=summary["adapter"], verifier=verifier3)
    batch = trainer._micro_batch(0)
    args = (batch.input_ids, batch.starts, GAMMA, batch.features)
    with torch.no_grad():
        want = trainer.drafter.eval().window_logits(*args)
        got = merged.window_logits(*args)
        plain = load_drafter(base, verifier=verifier3).window_logits(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-4)  # the adapter was trained

    report = run_eval(EvalConfig(
        data=str(greedy_data), verifier=str(verifier3), gamma=GAMMA, max_windows=16,
        candidates=[f"dir={tmp_path / 'lora'}", f"ckpt={latest_checkpoint(tmp_path / 'lora')}"],
        output=str(tmp_path / "eval.json"), heldout_fraction=0.25))["results"]
    assert report["dir"]["expected_accepted_length"] == pytest.approx(
        report["ckpt"]["expected_accepted_length"], rel=1e-5)

    run_export(ExportConfig(run=str(tmp_path / "lora"), verifier=str(verifier3),
                            output=str(tmp_path / "shipped")))
    shipped = ConditionedDrafter.from_pretrained(tmp_path / "shipped", verifier3).eval()
    with torch.no_grad():  # float16 tensors
        torch.testing.assert_close(shipped.window_logits(*args), got, rtol=0.02, atol=0.05)


def test_add_layers_deepens_a_trained_drafter_without_changing_its_drafts_then_trains_them(
        tmp_path, greedy_data, verifier3):
    """`--add-layers`: a deeper drafter starts at the trained one's logits (new layers' output
    projections zero), its new layers learn, and it resumes and ships at its new depth."""
    from vllm_specdiff.drafter.conditioned import ConditionedDrafter

    base = Trainer(_cfg(greedy_data, tmp_path / "base", verifier3, steps=3)).run()["model"]
    deeper = Trainer(_cfg(greedy_data, tmp_path / "deep", verifier3, drafter=base, add_layers=1,
                          steps=4, save_every=2))
    assert deeper.drafter.cfg.num_hidden_layers == 2
    batch = deeper._micro_batch(0)
    args = (batch.input_ids, batch.starts, GAMMA, batch.features)
    shallow = ConditionedDrafter.from_pretrained(base, verifier3).eval()
    with torch.no_grad():
        torch.testing.assert_close(deeper.drafter.eval().window_logits(*args),
                                   shallow.window_logits(*args))
    new = deeper.drafter.layers[1]
    before = {n: p.detach().clone() for n, p in new.named_parameters()}
    summary = deeper.run()
    changed = [n for n, p in new.named_parameters() if not torch.equal(p, before[n])]
    assert any("o_proj" in n for n in changed) and any("q_proj" in n for n in changed)

    shipped = ConditionedDrafter.from_pretrained(summary["model"], verifier3).eval()
    rebuilt = drafter_from_checkpoint(latest_checkpoint(tmp_path / "deep"))
    assert shipped.cfg.num_hidden_layers == rebuilt.cfg.num_hidden_layers == 2
    with torch.no_grad():
        torch.testing.assert_close(rebuilt.window_logits(*args),
                                   deeper.drafter.eval().window_logits(*args))
    with pytest.raises(ValueError, match="--add-layers deepens a trained conditioned drafter"):
        _cfg(greedy_data, tmp_path, verifier3, add_layers=1).validate()


def test_add_taps_widens_a_trained_drafter_without_changing_its_drafts_then_trains_them(
        tmp_path, greedy_data, verifier3):
    """`--add-taps`: a drafter that reads one more verifier layer starts at the trained one's
    logits (zero projection columns for the new tap), learns to use it, and ships wider."""
    from vllm_specdiff.drafter.conditioned import ConditionedDrafter

    base = Trainer(_cfg(greedy_data, tmp_path / "base", verifier3, num_taps=1,
                        steps=3)).run()["model"]
    assert ConditionedDrafter.from_pretrained(base, verifier3).feature_taps == (0,)
    wider = Trainer(_cfg(greedy_data, tmp_path / "wide", verifier3, drafter=base,
                         add_taps=["1"], steps=4, save_every=2))
    assert wider.drafter.feature_taps == (0, 1)
    batch = wider._micro_batch(0)
    assert batch.features.shape[-1] == 2 * wider.drafter.cfg.hidden_size
    narrow = ConditionedDrafter.from_pretrained(base, verifier3).eval()
    with torch.no_grad():
        got = wider.drafter.eval().window_logits(batch.input_ids, batch.starts, GAMMA,
                                                 batch.features)
        torch.testing.assert_close(got, narrow.window_logits(
            batch.input_ids, batch.starts, GAMMA, batch.features[..., :narrow.cfg.hidden_size]))
        # negative control: fed the new tap's columns instead, the trained drafter drafts
        # otherwise, so the comparison above sees which columns the old tap reads
        assert not torch.equal(got, narrow.window_logits(
            batch.input_ids, batch.starts, GAMMA, batch.features[..., narrow.cfg.hidden_size:]))
    h = wider.drafter.cfg.hidden_size
    summary = wider.run()
    assert wider.drafter.fc.weight[:, h:].abs().sum() > 0  # the new tap is read now
    shipped = ConditionedDrafter.from_pretrained(summary["model"], verifier3)
    rebuilt = drafter_from_checkpoint(latest_checkpoint(tmp_path / "wide"))
    assert shipped.feature_taps == rebuilt.feature_taps == (0, 1)
    with pytest.raises(ValueError, match="--add-taps widens a trained conditioned drafter"):
        _cfg(greedy_data, tmp_path, verifier3, add_taps=[1]).validate()
    with pytest.raises(ValueError, match="--add-taps takes verifier layer numbers"):
        _cfg(greedy_data, tmp_path, verifier3, drafter=base, add_taps=["x"]).validate()
    with pytest.raises(ValueError, match="must be layers 0..N-2"):
        Trainer(_cfg(greedy_data, tmp_path / "bad", verifier3, drafter=base, add_taps=[2]))
    with pytest.raises(ValueError, match="are read already"):
        Trainer(_cfg(greedy_data, tmp_path / "same", verifier3, drafter=base, add_taps=[0]))


def test_conditioned_arch_refuses_an_existing_drafter_or_a_missing_verifier(tmp_path, greedy_data,
                                                                            verifier3):
    with pytest.raises(ValueError, match="--init-from"):
        _cfg(greedy_data, tmp_path, None).validate()
    with pytest.raises(ValueError, match="--arch"):
        _cfg(greedy_data, tmp_path, verifier3, arch="dflash").validate()


def test_a_run_or_checkpoint_of_the_removed_injected_arch_is_refused_by_name(tmp_path):
    removed = "--arch injected .*was removed"
    with pytest.raises(ValueError, match=removed):  # a new or resumed run, or train_config.json
        _cfg(tmp_path, tmp_path, None, arch="injected", drafter=str(tmp_path)).validate()
    ckpt = tmp_path / "checkpoints" / "step-00003"  # a checkpoint an injected run saved
    ckpt.mkdir(parents=True)
    config = {**_cfg(tmp_path, tmp_path, None).__dict__, "arch": "injected",
              "drafter": str(tmp_path), "verifier": str(tmp_path)}
    (ckpt / "state.json").write_text(json.dumps({"step": 3, "config": config}))
    with pytest.raises(ValueError, match=removed):
        drafter_from_checkpoint(ckpt)
