"""`eval`: how well drafters (checkpoints, adapters) agree with the verifier on held-out windows.

For each held-out window (context s cut from a verifier sequence) and each candidate drafter:
- expected accepted length: K drafts sampled from the drafter marginals at T_d, the verifier run on
  s + draft, tau = sum_j prod_i p(x_i | s, x_<i) (ALGORITHM.md section 2, core `expected_streak`);
  with K > 1 also the self-selected max_k tau;
- greedy accepted length: leading positions where the drafter's argmax equals the verifier's greedy
  token (core `verify_greedy`), counted by core `SpecDecodeStats`;
- the per-position acceptance curve gamma_j = P(j accepted | 1..j-1 accepted) for both (the paper's
  Figure 2), written as JSON and plotted side by side as PNG.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from vllm_specdiff.core.metrics import SpecDecodeStats
from vllm_specdiff.core.sampling import draft_marginals, sample_drafts, target_probs
from vllm_specdiff.core.scoring import expected_streak
from vllm_specdiff.provenance import provenance

from .data import check_fingerprint, load_sequences, split_heldout, tokenizer_fingerprint
from .losses import expected_streak_of
from .model import drafter_from_checkpoint
from .windows import VocabMap, eval_windows, make_batch

log = logging.getLogger(__name__)

MIN_REACH = 1e-4  # below this P(1..j-1 accepted), the conditional acceptance of j is not shown


@dataclass
class Candidate:
    name: str
    drafter: str
    lora: str | None = None
    checkpoint: bool = False  # `drafter` is a `train` checkpoint directory


@dataclass
class EvalConfig:
    data: str
    verifier: str
    candidates: list[str] = field(default_factory=list)
    output: str = "eval.json"
    gamma: int = 8
    draft_temperature: float = 1.0
    verifier_temperature: float = 1.0  # the p in tau; 0 = greedy (one-hot) verifier
    num_drafts: int = 1
    windows_per_seq: int = 4
    max_windows: int = 128
    split: str = "heldout"  # heldout | all
    heldout_fraction: float | None = None  # None: the fraction the candidates' `train` used
    seed: int = 0
    batch_size: int = 8  # held-out sequences (each with its windows) per drafter/verifier call
    plot: bool = True

    def validate(self) -> None:
        if not self.candidates:
            raise ValueError("pass at least one --candidate")
        if self.gamma < 1 or self.num_drafts < 1 or self.max_windows < 1:
            raise ValueError("--gamma, --num-drafts and --max-windows must be >= 1")
        if self.draft_temperature < 0 or self.verifier_temperature < 0:
            raise ValueError("temperatures must be >= 0")
        if self.split not in ("heldout", "all"):
            raise ValueError(f"--split must be heldout or all, got {self.split!r}")


def parse_candidate(spec: str) -> Candidate:
    """`[NAME=]PATH[+ADAPTER]`: a drafter dir, a `train` output dir (its result is used), or one
    of its checkpoints (`OUT/checkpoints/step-N`)."""
    name, _, rest = spec.rpartition("=") if "=" in spec else ("", "", spec)
    path, _, lora = rest.partition("+")
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"--candidate {spec}: {path} is not a directory")
    if (p / "state.json").is_file() and (p / "trainable.safetensors").is_file():
        _refuse_ar(spec, json.loads((p / "state.json").read_text())["config"])
        return Candidate(name or f"{p.parent.parent.name}/{p.name}", path, checkpoint=True)
    summary = p / "train_summary.json"
    if summary.is_file() and not lora:
        s = json.loads(summary.read_text())
        _refuse_ar(spec, s)
        if "adapter" in s:
            return Candidate(name or p.name, s["base"], s["adapter"])
        return Candidate(name or p.name, s["model"])
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"--candidate {spec}: {path} is neither a drafter (config.json), "
                                f"a `train` output (train_summary.json) nor a checkpoint")
    return Candidate(name or (p.name + (f"+{Path(lora).name}" if lora else "")), path, lora or None)


def _refuse_ar(spec: str, run: dict) -> None:
    """eval scores one-shot (diffusion) drafts; an AR drafter's are sequential."""
    if run.get("objective") == "ar":
        raise ValueError(f"--candidate {spec}: an --objective ar run is an autoregressive "
                         f"drafter, which eval does not score; `train` logs its exact held-out "
                         f"accepted lengths, and `vllm-specdiff bench` measures it as vLLM's "
                         f"draft_model")


def _verifier_rows(batch_input: torch.Tensor, starts: list[int], drafts: torch.Tensor,
                   pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows `context[:s] + draft` for each window's drafts [N, R, G] -> [N*R, L]."""
    n, r, g = drafts.shape
    width = max(starts) + g
    ids = torch.full((n * r, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n * r, width), dtype=torch.long)
    for w in range(n):
        s = starts[w]
        for k in range(r):
            row = w * r + k
            ids[row, :s] = batch_input[w, :s]
            ids[row, s:s + g] = drafts[w, k]
            mask[row, :s + g] = 1
    return ids, mask


class Evaluator:
    def __init__(self, cfg: EvalConfig) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        cfg.validate()
        self.cfg = cfg
        data = load_sequences(Path(cfg.data))
        tok = AutoTokenizer.from_pretrained(cfg.verifier)
        check_fingerprint(data.meta, tokenizer_fingerprint(tok), f"--verifier {cfg.verifier}")
        self.data = data if cfg.split == "all" else split_heldout(data, cfg.heldout_fraction)[1]
        self.windows = eval_windows(self.data, cfg.gamma, cfg.windows_per_seq, cfg.max_windows,
                                    seed=cfg.seed)
        self.verifier = AutoModelForCausalLM.from_pretrained(cfg.verifier, dtype=torch.float32)
        self.verifier.eval()
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0

    def _verifier_logits(self, ids: torch.Tensor, mask: torch.Tensor, starts: list[int],
                         rows_per_window: int) -> torch.Tensor:
        """Verifier logits predicting draft positions 1..G+1: [N*R, G+1, V]."""
        g = self.cfg.gamma
        with torch.inference_mode():
            logits = self.verifier(input_ids=ids, attention_mask=mask).logits.float()
        s = torch.tensor(starts).repeat_interleave(rows_per_window)
        index = (s - 1)[:, None] + torch.arange(g + 1)[None]
        return logits.gather(1, index[..., None].expand(-1, -1, logits.shape[-1]))

    def evaluate(self, cand: Candidate) -> dict[str, Any]:
        from vllm_specdiff.drafter.loading import load_drafter

        cfg = self.cfg
        if cand.checkpoint:
            drafter = drafter_from_checkpoint(Path(cand.drafter))
        else:
            drafter = load_drafter(cand.drafter, lora=cand.lora, cache_size=0)
        vocab = VocabMap(drafter.vocab_size, drafter.draft_to_verifier)
        gen = torch.Generator().manual_seed(cfg.seed)
        greedy_stats = SpecDecodeStats()
        taus, selected, token_streaks = [], [], []
        reach = torch.zeros(cfg.gamma + 1)  # sum over drafts of prod_{i<=j} a_i, j = 0..G
        for lo in tqdm(range(0, len(self.windows), cfg.batch_size), desc=f"eval {cand.name}",
                       unit="batch"):
            part = self.windows[lo:lo + cfg.batch_size]
            batch = make_batch(self.data, [i for i, _ in part], [s for _, s in part], cfg.gamma)
            with torch.inference_mode():
                raw = drafter.window_logits(batch.input_ids, batch.starts, cfg.gamma)
            raw = raw[batch.valid].float()
            token_streaks.append(expected_streak_of(raw, batch.targets(vocab),
                                                    max(cfg.draft_temperature, 1e-6)))
            logits = drafter.to_verifier_vocab(raw)  # [N, G, V]
            v = logits.shape[-1]
            drafts = sample_drafts(draft_marginals(logits, cfg.draft_temperature), cfg.num_drafts,
                                   generator=gen)  # [N, K, G]
            greedy = logits.argmax(-1)[:, None]  # [N, 1, G]
            rows = torch.cat([drafts, greedy], dim=1)
            starts = batch.starts[batch.valid].tolist()
            inputs = batch.input_ids[batch.valid.nonzero()[:, 0]]
            ids, mask = _verifier_rows(inputs, starts, rows, self.pad_id)
            vl = self._verifier_logits(ids, mask, starts, cfg.num_drafts + 1)
            if vl.shape[-1] < v:
                raise ValueError(f"the verifier has {vl.shape[-1]} logits but the drafter "
                                 f"{cand.name} covers {v} ids")
            vl = vl[..., :v].reshape(len(starts), cfg.num_drafts + 1, cfg.gamma + 1, v)
            # Expected accepted length of the sampled drafts under the verifier's p.
            sampled = vl[:, :cfg.num_drafts, :cfg.gamma].reshape(-1, v)
            p = target_probs(sampled, cfg.verifier_temperature)
            a = p.gather(1, drafts.reshape(-1, 1)).reshape(len(starts), cfg.num_drafts, cfg.gamma)
            log_a = a.log()
            tau = expected_streak(log_a)  # [N, K]
            taus.append(tau.reshape(-1))
            selected.append(tau.max(dim=1).values)
            prods = torch.cat([torch.ones(*log_a.shape[:2], 1), log_a.cumsum(-1).exp()], dim=-1)
            reach += prods.reshape(-1, cfg.gamma + 1).sum(0)
            # Greedy: drafter argmax against the verifier's argmax along the same prefix.
            verdict = _verify_greedy(vl[:, -1].argmax(-1), greedy[:, 0])
            greedy_stats.record(verdict, cfg.gamma)
        tau_all = torch.cat(taus)
        drafts_scored = tau_all.numel()
        # P(j accepted | 1..j-1 accepted) is a ratio of tiny numbers once the prefix is almost
        # never accepted: report null there rather than noise.
        curve = [float(reach[j + 1] / reach[j]) if reach[j] / drafts_scored > MIN_REACH else None
                 for j in range(cfg.gamma)]
        greedy_dict = greedy_stats.to_dict()
        greedy_curve = [acc if reached else None for acc, reached in
                        zip(greedy_dict["per_position_acceptance"], greedy_stats.position_reached,
                            strict=True)]
        return {
            "drafter": cand.drafter, "lora": cand.lora, "windows": len(torch.cat(selected)),
            "expected_accepted_length": float(tau_all.mean()),
            "expected_accepted_length_selected": float(torch.cat(selected).mean()),
            "greedy_accepted_length": greedy_stats.mean_accepted_length,
            "verifier_token_streak": float(torch.cat(token_streaks).mean()),
            "per_position_acceptance_expected": curve,
            "prefix_acceptance_expected": (reach[1:] / drafts_scored).tolist(),
            "per_position_acceptance_greedy": greedy_curve,
            "greedy_accepted_length_histogram": greedy_dict["accepted_length_histogram"],
        }


def _verify_greedy(target_argmax: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    from vllm_specdiff.core.acceptance import verify_greedy

    return verify_greedy(target_argmax, draft).num_accepted


def plot_curves(results: dict[str, dict], gamma: int, path: Path) -> Path:
    """The paper's Figure 2: per-position acceptance, one line per candidate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    xs = list(range(1, gamma + 1))
    for name, r in results.items():
        nan = float("nan")
        axes[0].plot(xs, [nan if v is None else v for v in r["per_position_acceptance_expected"]],
                     marker="o", label=f"{name} (tau={r['expected_accepted_length']:.3f})")
        axes[1].plot(xs, [nan if v is None else v for v in r["per_position_acceptance_greedy"]],
                     marker="o", label=f"{name} (greedy={r['greedy_accepted_length']:.3f})")
    axes[0].set_title("sampled drafts: P(j accepted | 1..j-1 accepted)")
    axes[1].set_title("greedy drafts vs greedy verifier")
    for ax in axes:
        ax.set_xlabel("draft position j")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("per-position acceptance")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _train_heldout_fraction(specs: list[str]) -> float:
    """The held-out split the candidates were trained with, so eval never scores training data."""
    seen = set()
    for spec in specs:
        path = Path(spec.rpartition("=")[2].partition("+")[0])
        if (path / "train_config.json").is_file():
            seen.add(json.loads((path / "train_config.json").read_text())["heldout_fraction"])
        elif (path / "state.json").is_file():
            seen.add(json.loads((path / "state.json").read_text())["config"]["heldout_fraction"])
    if len(seen) > 1:
        raise ValueError(f"the candidates were trained with different held-out fractions "
                         f"{sorted(seen)}: pass --heldout-fraction")
    return seen.pop() if seen else 0.05


def run_eval(cfg: EvalConfig) -> dict[str, Any]:
    """Evaluate every candidate on the same windows; write JSON (and a PNG) to cfg.output."""
    cfg.validate()
    candidates = [parse_candidate(c) for c in cfg.candidates]
    names = [c.name for c in candidates]
    if len(set(names)) != len(names):
        raise ValueError(f"--candidate names must differ, got {names}: use NAME=PATH")
    if cfg.heldout_fraction is None:
        cfg.heldout_fraction = _train_heldout_fraction(cfg.candidates)
    ev = Evaluator(cfg)
    results = {c.name: ev.evaluate(c) for c in candidates}
    out = {
        "settings": {**asdict(cfg), "windows": sum(len(s) for _, s in ev.windows)},
        **provenance(),
        "results": results,
    }
    path = Path(cfg.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    if cfg.plot:
        out["plot"] = str(plot_curves(results, cfg.gamma, path.with_suffix(".png")))
    path.write_text(json.dumps(out, indent=2) + "\n")
    for cand in candidates:
        if cand.lora:  # the adapter directory carries its own eval results
            (Path(cand.lora) / "eval_results.json").write_text(
                json.dumps({**out, "results": {cand.name: results[cand.name]}}, indent=2) + "\n")
    return out
