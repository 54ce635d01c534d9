"""`eval`: how well drafters (checkpoints, adapters) agree with the verifier on held-out windows.

For each held-out window (context s cut from a verifier sequence) and each candidate drafter:
- expected accepted length: K drafts sampled from the drafter marginals at T_d, the verifier run on
  s + draft, tau = sum_j prod_i p(x_i | s, x_<i) (ALGORITHM.md section 2, core `expected_streak`);
  with K > 1 also the self-selected max_k tau;
- greedy accepted length: leading positions where the drafter's argmax equals the verifier's greedy
  token (core `verify_greedy`), counted by core `SpecDecodeStats`;
- the per-position acceptance curve gamma_j = P(j accepted | 1..j-1 accepted) for both (the paper's
  Figure 2), written as JSON and plotted side by side as PNG;
- always, with no verifier pass (all of `--no-verifier-pass`): the drafter against the data's own
  tokens, `verifier_token_streak` sum_j prod q_k(x_k) and `data_greedy_accepted_length` (leading
  argmax matches), with their curves. Both are sums over x of P(x) Q(x), so on temperature-1 data
  they estimate without bias the expected accepted length at T = 1 of sampled / greedy drafts, and
  on greedy data they are the accepted lengths against the greedy verifier.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from vllm_specdiff.core import DEFAULT_GAMMA
from vllm_specdiff.core.metrics import SpecDecodeStats
from vllm_specdiff.core.sampling import draft_marginals, sample_drafts, target_probs
from vllm_specdiff.core.scoring import expected_streak
from vllm_specdiff.drafter.checkpoint import read_config
from vllm_specdiff.drafter.conditioned import MODEL_TYPE as CONDITIONED_TYPE
from vllm_specdiff.provenance import portable, provenance

from .data import (
    SequenceData,
    check_fingerprint,
    load_sequences,
    split_heldout,
    tokenizer_fingerprint,
)
from .features import attach_features
from .losses import Targets, expected_streak_of, greedy_accepted_of, hard_log_accept
from .model import drafter_from_checkpoint
from .replay import input_lookahead, replay_greedy
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
    gamma: int = DEFAULT_GAMMA
    drafter_temperature: float = 1.0
    verifier_temperature: float = 1.0  # the p in tau; 0 = greedy (one-hot) verifier
    num_drafts: int = 1
    windows_per_seq: int = 4
    max_windows: int = 128
    split: str = "heldout"  # heldout | all
    heldout_fraction: float | None = None  # None: the fraction the candidates' `train` used
    seed: int = 0
    batch_size: int = 8  # held-out sequences (each with its windows) per drafter/verifier call
    plot: bool = True
    verifier_pass: bool = True  # False: score against the data's tokens only (no verifier run)
    replay: bool = False  # also replay every sequence in serving order (training/replay.py)
    tree_budgets: list[int] = field(default_factory=list)  # with replay: best-first trees too

    def validate(self) -> None:
        if not self.candidates:
            raise ValueError("pass at least one --candidate")
        if self.gamma < 1 or self.num_drafts < 1 or self.max_windows < 1:
            raise ValueError("--gamma, --num-drafts and --max-windows must be >= 1")
        if self.drafter_temperature < 0 or self.verifier_temperature < 0:
            raise ValueError("temperatures must be >= 0")
        if any(b < 1 for b in self.tree_budgets) or (self.tree_budgets and not self.replay):
            raise ValueError("--tree-budgets takes node budgets >= 1, with --replay")
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
        self.full = data  # verifier features are attached to it (in shard order) when needed
        self.data = self._split(data)
        self.windows = eval_windows(self.data, cfg.gamma, cfg.windows_per_seq, cfg.max_windows,
                                    seed=cfg.seed)
        self.verifier = None
        if cfg.verifier_pass:
            self.verifier = AutoModelForCausalLM.from_pretrained(cfg.verifier,
                                                                 dtype=torch.float32).eval()
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0

    def _split(self, data: SequenceData) -> SequenceData:
        cfg = self.cfg
        return data if cfg.split == "all" else split_heldout(data, cfg.heldout_fraction)[1]

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
        elif read_config(cand.drafter).get("model_type") == CONDITIONED_TYPE:
            drafter = load_drafter(cand.drafter, lora=cand.lora, verifier=cfg.verifier)
        else:
            drafter = load_drafter(cand.drafter, lora=cand.lora, cache_size=0)
        taps = getattr(drafter, "feature_taps", ())  # an AR drafter has none
        if taps and self.full.meta.get("_taps") != taps:  # teacher-forced verifier features
            attach_features(self.full, cfg.verifier, taps)
            self.full.meta["_taps"] = taps
            self.data = self._split(self.full)
        vocab = VocabMap(drafter.vocab_size, drafter.draft_to_verifier)
        on_data = _DataScores(cfg.gamma, max(cfg.drafter_temperature, 1e-6))
        on_verifier = _VerifierScores(cfg) if self.verifier is not None else None
        for lo in tqdm(range(0, len(self.windows), cfg.batch_size), desc=f"eval {cand.name}",
                       unit="batch"):
            part = self.windows[lo:lo + cfg.batch_size]
            batch = make_batch(self.data, [i for i, _ in part], [s for _, s in part], cfg.gamma,
                               lookahead=input_lookahead(drafter, cfg.gamma))
            with torch.inference_mode():
                raw = drafter.window_logits(batch.input_ids, batch.starts, cfg.gamma) \
                    if not taps else drafter.window_logits(batch.input_ids, batch.starts,
                                                           cfg.gamma, batch.features)
            raw = raw[batch.valid].float()
            on_data.add(raw, batch.targets(vocab))
            if on_verifier is not None:
                starts = batch.starts[batch.valid].tolist()
                inputs = batch.input_ids[batch.valid.nonzero()[:, 0]]
                on_verifier.add(self, cand.name, drafter.to_verifier_vocab(raw), inputs, starts)
        verifier_result = on_verifier.result() if on_verifier is not None else \
            dict.fromkeys(VERIFIER_KEYS)
        replayed = replay_greedy(drafter, self.data, cfg.gamma, tuple(cfg.tree_budgets)) \
            if cfg.replay else {}
        return {"drafter": cand.drafter, "lora": cand.lora, "windows": on_data.windows,
                **verifier_result, **on_data.result(), **replayed}


# What only the verifier pass measures (None with --no-verifier-pass).
VERIFIER_KEYS = ("expected_accepted_length", "expected_accepted_length_selected",
                 "greedy_accepted_length", "per_position_acceptance_expected",
                 "prefix_acceptance_expected", "per_position_acceptance_greedy",
                 "greedy_accepted_length_histogram", "expected_accepted_length_per_window",
                 "greedy_accepted_length_per_window")


def _conditional(reach: torch.Tensor, count: int) -> list[float | None]:
    """P(j accepted | 1..j-1 accepted) from reach[j] = sum of P(1..j accepted), reach[0] = count.

    A ratio of tiny numbers once the prefix is almost never accepted: null there, not noise."""
    return [float(reach[j + 1] / reach[j]) if reach[j] / max(count, 1) > MIN_REACH else None
            for j in range(reach.shape[0] - 1)]


class _DataScores:
    """The drafter against the data's own verifier tokens (no verifier pass): the expected
    streak sum_j prod q_k(x_k), which on temperature-1 data is an unbiased estimate of the
    expected accepted length at T = 1 (sum over x of P(x) Q(x) either way), and the greedy
    draft's leading matches, which on greedy data is its accepted length at T = 0."""

    def __init__(self, gamma: int, temperature: float) -> None:
        self.temperature = temperature
        self.streaks: list[torch.Tensor] = []
        self.greedy: list[torch.Tensor] = []
        self.streak_reach = torch.zeros(gamma + 1)
        self.greedy_reach = torch.zeros(gamma + 1)

    def add(self, raw: torch.Tensor, targets: Targets) -> None:
        with torch.no_grad():
            prefix = hard_log_accept(raw, targets, self.temperature).cumsum(-1).exp()  # [N, G]
        matches = (raw.argmax(-1) == targets.tokens).long().cumprod(-1)  # [N, G]
        self.streaks.append(expected_streak_of(raw, targets, self.temperature))
        self.greedy.append(greedy_accepted_of(raw, targets))
        self.streak_reach += torch.cat([torch.full((1,), float(raw.shape[0])), prefix.sum(0)])
        self.greedy_reach += torch.cat([torch.full((1,), float(raw.shape[0])),
                                        matches.sum(0).float()])

    @property
    def windows(self) -> int:
        return int(self.streak_reach[0])

    def result(self) -> dict[str, Any]:
        streaks, greedy = torch.cat(self.streaks), torch.cat(self.greedy)
        return {
            "verifier_token_streak": float(streaks.mean()),
            "data_greedy_accepted_length": float(greedy.float().mean()),
            "per_position_acceptance_data_streak": _conditional(self.streak_reach, self.windows),
            "per_position_acceptance_data_greedy": _conditional(self.greedy_reach, self.windows),
            "verifier_token_streak_per_window": _rounded(streaks),
            "data_greedy_accepted_length_per_window": greedy.tolist(),
        }


class _VerifierScores:
    """Drafts scored by the verifier run on them: expected (sampled drafts, p at
    --verifier-temperature) and greedy accepted length, and their per-position curves."""

    def __init__(self, cfg: EvalConfig) -> None:
        self.cfg = cfg
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.greedy_stats = SpecDecodeStats()
        self.taus: list[torch.Tensor] = []
        self.selected: list[torch.Tensor] = []
        self.window_taus: list[torch.Tensor] = []
        self.greedy_lengths: list[torch.Tensor] = []
        self.reach = torch.zeros(cfg.gamma + 1)  # sum over drafts of prod_{i<=j} a_i, j = 0..G

    def add(self, ev: Evaluator, name: str, logits: torch.Tensor, inputs: torch.Tensor,
            starts: list[int]) -> None:
        cfg = self.cfg
        v = logits.shape[-1]  # logits [N, G, V] in verifier ids
        drafts = sample_drafts(draft_marginals(logits, cfg.drafter_temperature), cfg.num_drafts,
                               generator=self.gen)  # [N, K, G]
        greedy = logits.argmax(-1)[:, None]  # [N, 1, G]
        rows = torch.cat([drafts, greedy], dim=1)
        ids, mask = _verifier_rows(inputs, starts, rows, ev.pad_id)
        vl = ev._verifier_logits(ids, mask, starts, cfg.num_drafts + 1)
        if vl.shape[-1] < v:
            raise ValueError(f"the verifier has {vl.shape[-1]} logits but the drafter "
                             f"{name} covers {v} ids")
        vl = vl[..., :v].reshape(len(starts), cfg.num_drafts + 1, cfg.gamma + 1, v)
        # Expected accepted length of the sampled drafts under the verifier's p.
        sampled = vl[:, :cfg.num_drafts, :cfg.gamma].reshape(-1, v)
        p = target_probs(sampled, cfg.verifier_temperature)
        a = p.gather(1, drafts.reshape(-1, 1)).reshape(len(starts), cfg.num_drafts, cfg.gamma)
        log_a = a.log()
        tau = expected_streak(log_a)  # [N, K]
        self.taus.append(tau.reshape(-1))
        self.window_taus.append(tau.mean(dim=1))
        self.selected.append(tau.max(dim=1).values)
        prods = torch.cat([torch.ones(*log_a.shape[:2], 1), log_a.cumsum(-1).exp()], dim=-1)
        self.reach += prods.reshape(-1, cfg.gamma + 1).sum(0)
        # Greedy: drafter argmax against the verifier's argmax along the same prefix.
        verdict = _verify_greedy(vl[:, -1].argmax(-1), greedy[:, 0])
        self.greedy_stats.record(verdict, cfg.gamma)
        self.greedy_lengths.append(verdict.float())

    def result(self) -> dict[str, Any]:
        tau_all = torch.cat(self.taus)
        greedy_dict = self.greedy_stats.to_dict()
        greedy_curve = [acc if reached else None for acc, reached in
                        zip(greedy_dict["per_position_acceptance"],
                            self.greedy_stats.position_reached, strict=True)]
        return {
            "expected_accepted_length": float(tau_all.mean()),
            "expected_accepted_length_selected": float(torch.cat(self.selected).mean()),
            "greedy_accepted_length": self.greedy_stats.mean_accepted_length,
            "per_position_acceptance_expected": _conditional(self.reach, tau_all.numel()),
            "prefix_acceptance_expected": (self.reach[1:] / tau_all.numel()).tolist(),
            "per_position_acceptance_greedy": greedy_curve,
            "greedy_accepted_length_histogram": greedy_dict["accepted_length_histogram"],
            # per window, in window order (the same windows for every candidate), so two
            # candidates' difference can be judged paired, window by window, against its noise
            "expected_accepted_length_per_window": _rounded(torch.cat(self.window_taus)),
            "greedy_accepted_length_per_window": torch.cat(self.greedy_lengths).int().tolist(),
        }


def _rounded(values: torch.Tensor) -> list[float]:
    return [round(float(v), 5) for v in values]


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
    verified = all(r["expected_accepted_length"] is not None for r in results.values())
    # (curve, figure, label) per panel: the verifier's scores, or without its pass the data's
    panels = ((("per_position_acceptance_expected", "expected_accepted_length", "tau"),
               ("per_position_acceptance_greedy", "greedy_accepted_length", "greedy"))
              if verified else
              (("per_position_acceptance_data_streak", "verifier_token_streak", "streak"),
               ("per_position_acceptance_data_greedy", "data_greedy_accepted_length", "greedy")))
    for name, r in results.items():
        for ax, (curve, figure, label) in zip(axes, panels, strict=True):
            ax.plot(xs, [float("nan") if v is None else v for v in r[curve]], marker="o",
                    label=f"{name} ({label}={r[figure]:.3f})")
    against = "verifier" if verified else "data's tokens"
    axes[0].set_title(f"sampled drafts vs the {against}: P(j accepted | 1..j-1 accepted)",
                      fontsize=9)
    axes[1].set_title(f"greedy drafts vs the {'greedy verifier' if verified else against}",
                      fontsize=9)
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
    out = portable(out)  # no folder of this machine in a result that may be committed
    path.write_text(json.dumps(out, indent=2) + "\n")
    for cand in candidates:
        if cand.lora:  # the adapter directory carries its own eval results
            (Path(cand.lora) / "eval_results.json").write_text(
                json.dumps({**out, "results": {cand.name: results[cand.name]}}, indent=2) + "\n")
    return out
