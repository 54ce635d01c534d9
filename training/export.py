"""`export`: a training run (or one of its checkpoints) -> a slim drafter directory + its curve.

This is how the default drafter is shipped: the latest checkpoint of a full fine-tuning run is
rebuilt, written as a slim checkpoint (only the tensors the verifier cannot rebuild, see
vllm_specdiff/drafter/slim.py), and the run's learning curve (held-out expected accepted length
against tokens seen and CPU hours) is written beside it as JSON and PNG. A run of
`train --objective ar` is written instead as a standard transformers causal LM directory (with
the verifier's tokenizer files), the draft model of vLLM's `draft_model` method.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_specdiff.drafter.checkpoint import read_config
from vllm_specdiff.drafter.conditioned import ConditionedDrafter
from vllm_specdiff.drafter.slim import slim_checkpoint
from vllm_specdiff.drafter.vocab import D2T_FILE, copy_tokenizer_files, save_d2t

from .data import load_sequences, split_heldout
from .data_vocab import build_data_vocab
from .export_dflash import export_dflash
from .model import drafter_from_checkpoint, merge_lora_layers, save_full
from .trainer import LOG_FILE, latest_checkpoint

CURVE_FILE = "learning_curve.json"


FORMATS = ("specdiff", "dflash")


@dataclass
class ExportConfig:
    verifier: str
    output: str
    run: str | None = None  # a `train` output directory (its latest checkpoint) or a checkpoint
    drafter: str | None = None  # or: a conditioned drafter directory (--format dflash)
    draft_vocab_size: int | None = None  # ship a reduced head: the run's N most frequent ids
    format: str = "specdiff"  # specdiff (the plugin's directory) | dflash (vLLM's own method)

    def validate(self) -> None:
        if (self.run is None) == (self.drafter is None):
            raise ValueError("pass exactly one of --run (a training run) or --drafter (a "
                             "conditioned drafter directory)")
        if self.format not in FORMATS:
            raise ValueError(f"--format must be {' or '.join(FORMATS)}, got {self.format!r}")
        if self.drafter is not None and self.format != "dflash":
            raise ValueError("--drafter is exported with --format dflash (a drafter directory "
                             "already is the plugin's format)")


def resolve_checkpoint(run: Path) -> tuple[Path, Path]:
    """(checkpoint, run directory) for a run directory or a checkpoint directory."""
    if (run / "state.json").is_file():
        return run, run.parent.parent
    checkpoint = latest_checkpoint(run)
    if checkpoint is None:
        raise FileNotFoundError(f"--run {run}: no checkpoint (state.json) in it or in "
                                f"{run}/checkpoints")
    return checkpoint, run


def earlier_stages(train_config: dict) -> list[dict]:
    """The curve of the exported drafter a run started from (`--drafter DIR` holding the
    learning_curve.json its export wrote), so a run in stages reports one curve from scratch."""
    start = train_config.get("drafter")
    path = Path(start) / CURVE_FILE if start else None
    if path is None or not path.is_file():
        return []
    saved = json.loads(path.read_text())
    name = Path(saved["run"]).name
    return [{**point, "run": point.get("run", name)} for point in saved["curve"]]


def learning_curve(run_dir: Path, up_to_step: int, earlier: list[dict] | None = None
                   ) -> list[dict]:
    """Cumulative tokens, wall and CPU hours at every step with a held-out measurement,
    continuing `earlier` (the curve of the stages before this run: steps, tokens and hours
    go on from its last point; each point names its run)."""
    path = run_dir / LOG_FILE
    earlier = list(earlier or [])
    if not path.is_file():
        return earlier
    last = earlier[-1] if earlier else {}
    step0 = last.get("step", 0)
    tokens = float(last.get("tokens_seen", 0))
    wall = 3600.0 * last.get("wall_hours", 0.0)
    cpu = 3600.0 * last.get("cpu_hours", 0.0)
    curve = earlier
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec["step"] > up_to_step:
            break
        if rec["step"] == 0 and earlier:  # a later stage's start is the earlier curve's end
            continue
        tokens += rec.get("tokens", 0)
        wall += rec.get("seconds", 0.0)
        cpu += rec.get("cpu_seconds", 0.0)
        if rec.get("heldout_expected_streak") is not None:
            curve.append({"step": step0 + rec["step"], "run": run_dir.name,
                          "tokens_seen": int(tokens),
                          "wall_hours": round(wall / 3600, 4), "cpu_hours": round(cpu / 3600, 4),
                          "heldout_expected_streak": rec["heldout_expected_streak"],
                          "heldout_greedy_accepted_length":
                              rec.get("heldout_greedy_accepted_length"),
                          "train_loss": rec["loss"]})
    return curve


def plot_learning_curve(curve: list[dict], path: Path, title: str = "default drafter") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, label in ((axes[0], "cpu_hours", "CPU hours"),
                           (axes[1], "tokens_seen", "tokens seen")):
        for run in dict.fromkeys(c.get("run") for c in curve):  # one line per stage
            part = [c for c in curve if c.get("run") == run]
            ax.plot([c[key] for c in part], [c["heldout_expected_streak"] for c in part],
                    marker="o", markersize=3, label=run)
        ax.set_xlabel(label)
        ax.set_ylabel("held-out expected accepted length")
        ax.grid(alpha=0.3)
    if len({c.get("run") for c in curve}) > 1:
        axes[0].legend(fontsize=7)
    fig.suptitle(f"{title}: learning curve")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _write_data_vocab(train_config: dict, size: int, verifier: str, out: Path) -> int:
    """d2t.safetensors from the run's training split (never its held-out prompts): the rows of
    the head load_drafter keeps. Rebuilt on every export, as the data may have grown."""
    data = load_sequences(Path(train_config["data"]))
    train_split, _ = split_heldout(data, train_config["heldout_fraction"])
    save_d2t(out / D2T_FILE, build_data_vocab(train_split, size, verifier))
    return size


def _export_causal(cfg: ExportConfig, checkpoint: Path, out: Path) -> dict:
    """An `--objective ar` run -> a transformers causal LM directory vLLM's draft_model loads."""
    from .causal import CausalLMDrafter

    if cfg.draft_vocab_size is not None:
        raise ValueError("--draft-vocab-size: an AR drafter keeps the verifier's full head "
                         "(vLLM's draft_model needs equal vocabularies)")
    drafter = drafter_from_checkpoint(checkpoint)
    assert isinstance(drafter, CausalLMDrafter)
    verifier_vocab = read_config(cfg.verifier).get("vocab_size")
    if verifier_vocab != drafter.vocab_size:
        raise ValueError(f"--verifier {cfg.verifier} has vocab_size {verifier_vocab}, the run's "
                         f"drafter {drafter.vocab_size}: another model?")
    drafter.save_pretrained(out)
    copy_tokenizer_files(cfg.verifier, out)
    return {"output": str(out), "checkpoint": str(checkpoint), "format": "causal_lm",
            "num_hidden_layers": drafter.num_layers}


def _export_conditioned(cfg: ExportConfig, drafter: ConditionedDrafter, out: Path) -> dict:
    if cfg.draft_vocab_size is not None:
        raise ValueError("--draft-vocab-size: a conditioned drafter's head is chosen when it is "
                         "trained (train --draft-vocab-size)")
    if cfg.format == "dflash":
        return export_dflash(drafter, cfg.verifier, out)
    # shipped: float16, and no tokenizer files (the verifier's own are used)
    drafter.save_pretrained(out, dtype=torch.float16)
    return {"output": str(out), "format": "specdiff", "model_type": drafter.cfg.model_type}


def run_export(cfg: ExportConfig) -> dict:
    cfg.validate()
    out = Path(cfg.output)
    if cfg.drafter is not None:
        drafter = ConditionedDrafter.from_pretrained(cfg.drafter, cfg.verifier)
        return _export_conditioned(cfg, drafter, out)
    checkpoint, run_dir = resolve_checkpoint(Path(cfg.run))
    state = json.loads((checkpoint / "state.json").read_text())
    if state["config"].get("arch") == "conditioned":
        drafter = drafter_from_checkpoint(checkpoint)
        if state["config"]["finetune"] == "lora":  # the adapter merged: a full drafter
            drafter = merge_lora_layers(drafter)
        summary = _export_conditioned(cfg, drafter, out)
        return {**summary, "step": state["step"],
                **_write_curve(run_dir, checkpoint, state, out, "conditioned drafter")}
    if cfg.format != "specdiff":
        raise ValueError("--format dflash exports conditioned drafters (train --arch "
                         "conditioned); this run trained another kind")
    if state["config"].get("objective") == "ar":
        out = Path(cfg.output)
        summary = _export_causal(cfg, checkpoint, out)
        return {**summary, "step": state["step"],
                **_write_curve(run_dir, checkpoint, state, out, "AR drafter")}
    if state["config"]["finetune"] != "full":
        raise ValueError("export writes slim full drafters: train with --finetune full (a LoRA "
                         "run is already small: ship its adapter directory instead)")
    trained_vocab = state["config"].get("draft_vocab") or state["config"].get("draft_vocab_size")
    if cfg.draft_vocab_size is not None and trained_vocab:  # before anything is written
        raise ValueError("--draft-vocab-size: this run already trained a reduced head")
    out = Path(cfg.output)
    drafter = drafter_from_checkpoint(checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        save_full(drafter, Path(tmp))
        sizes = slim_checkpoint(tmp, cfg.verifier, out)
    vocab = None
    if cfg.draft_vocab_size is not None:
        vocab = _write_data_vocab(state["config"], cfg.draft_vocab_size, cfg.verifier, out)
    else:
        (out / D2T_FILE).unlink(missing_ok=True)
    summary = {"output": str(out), "checkpoint": str(checkpoint), "step": state["step"],
               "draft_vocab_size": vocab, **sizes}
    return {**summary, **_write_curve(run_dir, checkpoint, state, out, "default drafter")}


def _write_curve(run_dir: Path, checkpoint: Path, state: dict, out: Path, title: str) -> dict:
    """learning_curve.json (and .png when the run measured held-out points) beside the export."""
    curve = learning_curve(run_dir, state["step"], earlier_stages(state["config"]))
    (out / CURVE_FILE).write_text(json.dumps(
        {"run": str(run_dir), "checkpoint": checkpoint.name, "train_config": state["config"],
         "curve": curve}, indent=2) + "\n")
    if not curve:
        return {}
    return {"plot": str(plot_learning_curve(curve, out / "learning_curve.png", title))}
