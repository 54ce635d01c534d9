"""`train`: streak-distillation of a diffusion drafter on verifier sequences (or, with
`--objective ar`, next-token training of an autoregressive baseline drafter, training/causal.py).

One optimizer step = `grad_accum` micro-batches of `batch_size` sequences x `windows_per_seq`
windows. Everything that decides what a step computes (the batch, dropout noise) is either a pure
function of (seed, step, rank) or saved in the checkpoint, so resuming continues with bit-identical
losses. Multi-GPU/multi-node runs go through accelerate (`accelerate launch` or `torchrun`):
each rank draws its own batches and DDP averages the gradients.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from vllm_specdiff.drafter.vocab import copy_tokenizer_files

from .data import (
    check_fingerprint,
    data_dirs,
    load_sequences,
    split_heldout,
    tokenizer_fingerprint,
)
from .data_vocab import ensure_data_vocab
from .features import attach_features
from .losses import SOFT_LOSSES, Targets, expected_streak_of, get_loss, greedy_accepted_of
from .model import (
    WindowModel,
    add_lora,
    build_for_arch,
    config_taps,
    enable_gradient_checkpointing,
    feature_source,
    load_trainable_state,
    save_adapter,
    save_full,
    select_trainable,
    trainable_state,
    write_json,
)
from .train_config import TrainConfig
from .verifier_topk import SOFT_TARGET_K, attach_verifier_topk
from .windows import (
    VocabMap,
    WindowBatch,
    batch_generator,
    eligible_sequences,
    eval_windows,
    make_batch,
    sample_batch,
)

log = logging.getLogger(__name__)

CKPT_DIR = "checkpoints"
LOG_FILE = "log.jsonl"
ADAPTER_DIR = "adapter"
MODEL_DIR = "model"


def resolve_mixed_precision(choice: str) -> str:
    """bf16 only where the hardware has it (on AVX2 CPUs bf16 autocast is ~30x slower than fp32)."""
    if choice != "auto":
        return choice
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def lr_lambda(schedule: str, warmup: int, total: int) -> object:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return factor


def _tokenizer_source(cfg: TrainConfig) -> str | None:
    for candidate in (cfg.tokenizer, cfg.drafter, cfg.init_from):
        if candidate and (Path(candidate) / "tokenizer_config.json").is_file():
            return candidate
        if candidate and (Path(candidate) / "tokenizer.json").is_file():
            return candidate
    return None


def check_data_tokenizer(meta: dict, cfg: TrainConfig) -> None:
    """Data made with another tokenizer is refused before any training happens."""
    source = _tokenizer_source(cfg)
    if source is None:
        if cfg.tokenizer:
            raise FileNotFoundError(f"--tokenizer {cfg.tokenizer}: no tokenizer files there")
        raise ValueError("no tokenizer next to the drafter: pass --tokenizer (the verifier "
                         "directory) so the data's token ids can be checked")
    from transformers import AutoTokenizer

    fp = tokenizer_fingerprint(AutoTokenizer.from_pretrained(source))
    check_fingerprint(meta, fp, f"the tokenizer in {source}")


# Settings a resumed run may change (how long and how often), all others must match.
_RESUMABLE_CHANGES = frozenset({"output", "steps", "save_every", "eval_every", "eval_windows",
                                "resume", "mixed_precision", "gradient_checkpointing"})
# Settings added after runs were saved, with the value those runs had.
_ADDED_FIELDS = {"objective": "diffusion", "add_layers": 0, "add_taps": [], "add_markov_rank": 0}
# Settings renamed after runs were saved: old name -> name now.
_RENAMED_FIELDS = {"draft_temperature": "drafter_temperature"}


def _check_same_run(checkpoint: Path, cfg: TrainConfig) -> None:
    """Resuming with other data, model or loss settings would silently train something else."""
    saved = {**_ADDED_FIELDS, **json.loads((checkpoint / "state.json").read_text())["config"]}
    saved = {_RENAMED_FIELDS.get(k, k): v for k, v in saved.items()}
    now = asdict(cfg)
    diff = sorted(k for k in now if k not in _RESUMABLE_CHANGES and saved.get(k) != now[k]
                  and not (k == "data" and _appends_data(saved[k], now[k])))
    if diff:
        raise ValueError(f"--output {cfg.output} holds a run with other settings "
                         f"({', '.join('--' + k.replace('_', '-') for k in diff)} differ); "
                         f"use the same settings to resume it, or a new --output")


def _appends_data(saved: str, now: str) -> bool:
    """A resumed run may train on more data: the saved directories, then more (--data A
    resumed as --data A,B). Nothing of the saved data may go or change places."""
    old, new = data_dirs(saved), data_dirs(now)
    return len(new) > len(old) and new[: len(old)] == old


def latest_checkpoint(out: Path) -> Path | None:
    ckpts = sorted((out / CKPT_DIR).glob("step-*"))
    ckpts = [c for c in ckpts if (c / "state.json").is_file()]
    return ckpts[-1] if ckpts else None


class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        from accelerate import Accelerator

        cfg.validate()
        self.cfg = cfg
        self.out = Path(cfg.output)
        # cpu=True lets accelerate run DDP over gloo when torchrun starts CPU-only processes.
        self.accelerator = Accelerator(mixed_precision=resolve_mixed_precision(cfg.mixed_precision),
                                       cpu=not torch.cuda.is_available())
        data = load_sequences(Path(cfg.data))
        check_data_tokenizer(data.meta, cfg)
        source = feature_source(asdict(cfg))
        if source is not None:
            attach_features(data, source, config_taps(asdict(cfg)), str(self.accelerator.device))
        if cfg.loss in SOFT_LOSSES and not data.has_soft_targets:
            if source is None:
                raise ValueError(f"--loss {cfg.loss} needs soft targets: regenerate the data "
                                 f"with `generate --top-logprobs K` (a conditioned drafter's "
                                 f"verifier computes them itself)")
            attach_verifier_topk(data, source, SOFT_TARGET_K, str(self.accelerator.device))
        self.train_data, self.heldout = split_heldout(data, cfg.heldout_fraction)
        self.soft = cfg.loss in SOFT_LOSSES

        torch.manual_seed(cfg.seed)
        draft_vocab = cfg.draft_vocab
        if cfg.draft_vocab_size is not None:
            draft_vocab = str(ensure_data_vocab(self.out, self.train_data, cfg.draft_vocab_size,
                                                cfg.tokenizer or cfg.init_from))
        self.drafter = build_for_arch(asdict(cfg), draft_vocab)
        # ar: the batch also holds the targets' prefixes, and no mask block is run
        self.lookahead = self.drafter.input_lookahead(cfg.gamma)  # ar, a Markov head: gamma - 1
        self.block_tokens = 0 if cfg.objective == "ar" else cfg.gamma
        # Windows must fit the drafter's position range (context + gamma).
        self.max_length = min(cfg.max_length or self.drafter.max_positions,
                              self.drafter.max_positions)
        self.eligible = eligible_sequences(self.train_data, cfg.gamma, cfg.min_context,
                                           self.max_length)
        if not self.eligible:
            raise ValueError(f"no training sequence has {cfg.gamma} generated tokens after the "
                             f"prompt (within --max-length {self.max_length}): generate longer "
                             f"continuations or lower --gamma")
        if data.meta.get("vocab_size", 0) > self.drafter.vocab_size:
            raise ValueError(f"the data's tokenizer has {data.meta['vocab_size']} ids but the "
                             f"drafter covers {self.drafter.vocab_size}: another tokenizer?")
        self.vocab = VocabMap(self.drafter.vocab_size, self.drafter.draft_to_verifier)
        self.lora_config = None
        if cfg.finetune == "lora":
            self.lora_config = add_lora(self.drafter, cfg.lora_rank, cfg.lora_alpha,
                                        cfg.lora_dropout, cfg.lora_targets)
        else:
            # a conditioned drafter shares the verifier's embedding and head, frozen
            shared = ["embed_tokens", "lm_head"] if cfg.arch == "conditioned" else []
            select_trainable(self.drafter, cfg.train_params, cfg.freeze_params + shared)
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(self.drafter)
        self.drafter.train()
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.num_trainable = sum(p.numel() for p in params)
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(cfg.schedule, cfg.warmup_steps, cfg.steps))
        # The scheduler stays unprepared: accelerate would step it once per process, but our
        # schedule counts optimizer steps.
        self.model, self.optimizer = self.accelerator.prepare(WindowModel(self.drafter), optimizer)
        self.scheduler = scheduler
        self.loss_fn = get_loss(cfg.loss)
        self.step = 0

    # ---- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        acc = self.accelerator
        path = self.out / CKPT_DIR / f"step-{self.step:07d}"
        path.mkdir(parents=True, exist_ok=True)
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, path / f"rng-{acc.process_index}.pt")
        if acc.is_main_process:
            save_file(trainable_state(self.drafter), str(path / "trainable.safetensors"))
            torch.save({"optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict()}, path / "optimizer.pt")
            write_json(path / "state.json", {"step": self.step, "config": asdict(self.cfg)})
        acc.wait_for_everyone()
        return path

    def load_checkpoint(self, path: Path) -> None:
        state = json.loads((path / "state.json").read_text())
        load_trainable_state(self.drafter, load_file(str(path / "trainable.safetensors")))
        opt = torch.load(path / "optimizer.pt", weights_only=False)
        self.optimizer.load_state_dict(opt["optimizer"])
        self.scheduler.load_state_dict(opt["scheduler"])
        rng_file = path / f"rng-{self.accelerator.process_index}.pt"
        if rng_file.is_file():
            rng = torch.load(rng_file, weights_only=False)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        self.step = int(state["step"])

    # ---- one step -------------------------------------------------------------------------------
    def _micro_batch(self, micro: int) -> WindowBatch:
        cfg = self.cfg
        gen = batch_generator(cfg.seed, self.step * cfg.grad_accum + micro,
                              self.accelerator.process_index)
        return sample_batch(self.train_data, self.eligible, cfg.batch_size, cfg.windows_per_seq,
                            cfg.gamma, gen, soft=self.soft, min_context=cfg.min_context,
                            max_length=self.max_length, lookahead=self.lookahead)

    def _forward(self, batch: WindowBatch) -> tuple[torch.Tensor, Targets]:
        """Logits [N, G, V_draft] of the batch's valid windows and their targets (drafter ids)."""
        device = self.accelerator.device
        features = None if batch.features is None else batch.features.to(device)
        logits = self.model(batch.input_ids.to(device), batch.starts.to(device), self.cfg.gamma,
                            features)
        logits = logits[batch.valid.to(device)]
        t = batch.targets(self.vocab)
        targets = Targets(t.tokens.to(device),
                          None if t.topk_ids is None else t.topk_ids.to(device),
                          None if t.topk_logprobs is None else t.topk_logprobs.to(device))
        return logits, targets

    def train_step(self) -> dict:
        cfg, acc = self.cfg, self.accelerator
        start, cpu_start = time.perf_counter(), time.process_time()
        total_loss, streak_sum, windows, tokens = 0.0, 0.0, 0, 0
        for micro in range(cfg.grad_accum):
            batch = self._micro_batch(micro)
            last = micro == cfg.grad_accum - 1
            ctx = acc.no_sync(self.model) if not last else contextlib.nullcontext()
            with ctx, acc.autocast():
                logits, targets = self._forward(batch)
                loss = self.loss_fn(logits, targets, cfg.drafter_temperature)
                mean = loss.mean() / cfg.grad_accum
                acc.backward(mean)
            total_loss += float(mean.detach())
            streak_sum += float(expected_streak_of(logits.detach(), targets,
                                                   cfg.drafter_temperature).sum())
            windows += batch.num_windows
            tokens += batch.input_ids.numel() + batch.num_windows * self.block_tokens
        grad_norm = float("nan")
        if cfg.max_grad_norm > 0:
            grad_norm = acc.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        seconds = time.perf_counter() - start
        if acc.num_processes > 1:  # log the mean over ranks, not rank 0's share
            totals = acc.reduce(torch.tensor([total_loss, streak_sum, windows, tokens],
                                             dtype=torch.float64, device=acc.device), "sum")
            total_loss = float(totals[0]) / acc.num_processes
            streak_sum, windows, tokens = float(totals[1]), int(totals[2]), int(totals[3])
        return {"step": self.step, "loss": total_loss, "expected_streak": streak_sum / windows,
                "lr": lr, "grad_norm": float(grad_norm), "windows": windows,
                "tokens": tokens, "tokens_per_s": tokens / seconds, "seconds": seconds,
                "cpu_seconds": time.process_time() - cpu_start}

    # ---- held-out measure (drafter only; `eval` adds the verifier) -----------------------------
    @torch.no_grad()
    def heldout_measures(self) -> dict[str, float | None]:
        """On held-out verifier windows: the mean sum_j prod q_k(x_k) (the expected accepted
        length at T_d) and the greedy draft's accepted length (both exact for an AR drafter,
        whose teacher-forced prefix is the accepted one)."""
        cfg = self.cfg
        none = {"heldout_expected_streak": None, "heldout_greedy_accepted_length": None}
        if len(self.heldout) == 0:
            return none
        try:
            chosen = eval_windows(self.heldout, cfg.gamma, cfg.windows_per_seq, cfg.eval_windows,
                                  cfg.min_context, self.max_length, cfg.seed)
        except ValueError:
            return none
        was_training = self.drafter.training
        self.drafter.eval()
        streak, greedy, count = 0.0, 0.0, 0
        for lo in range(0, len(chosen), cfg.batch_size):
            part = chosen[lo:lo + cfg.batch_size]
            batch = make_batch(self.heldout, [i for i, _ in part], [s for _, s in part], cfg.gamma,
                               lookahead=self.lookahead)
            with self.accelerator.autocast():
                logits, targets = self._forward(batch)
            streak += float(expected_streak_of(logits, targets, cfg.drafter_temperature).sum())
            greedy += float(greedy_accepted_of(logits, targets).sum())
            count += batch.num_windows
        self.drafter.train(was_training)
        return {"heldout_expected_streak": streak / count,
                "heldout_greedy_accepted_length": greedy / count}

    # ---- the loop -------------------------------------------------------------------------------
    def run(self) -> dict:
        cfg, acc = self.cfg, self.accelerator
        self.out.mkdir(parents=True, exist_ok=True)
        latest = latest_checkpoint(self.out)
        if latest is not None and not cfg.resume:
            raise ValueError(f"--output {self.out} holds checkpoints of an earlier run; resume it "
                             f"(drop --no-resume) or use a new --output")
        if latest is not None:
            _check_same_run(latest, cfg)
            self.load_checkpoint(latest)
            log.info("resumed from %s", latest)
            if acc.is_main_process:
                _truncate_log(self.out / LOG_FILE, self.step)
        else:
            start = self.heldout_measures() if cfg.eval_every else {}
            if acc.is_main_process:  # the curve starts where the drafter starts
                (self.out / LOG_FILE).unlink(missing_ok=True)
                if start:
                    with (self.out / LOG_FILE).open("a") as f:
                        f.write(json.dumps({"step": 0, "tokens": 0, "seconds": 0.0,
                                            "cpu_seconds": 0.0, "loss": None, **start}) + "\n")
        if acc.is_main_process:
            write_json(self.out / "train_config.json", asdict(cfg))
        bar = tqdm(total=cfg.steps, initial=self.step, desc=f"train ({cfg.loss})", unit="step",
                   disable=not acc.is_main_process)
        record: dict = {}
        while self.step < cfg.steps:
            record = self.train_step()
            if cfg.eval_every and self.step % cfg.eval_every == 0:
                record.update(self.heldout_measures())
            if acc.is_main_process:
                with (self.out / LOG_FILE).open("a") as f:
                    f.write(json.dumps(record) + "\n")
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", streak=f"{record['expected_streak']:.3f}",
                            tok_s=f"{record['tokens_per_s']:.0f}")
            if self.step % cfg.save_every == 0 or self.step == cfg.steps:
                self.save_checkpoint()
        bar.close()
        return self.finish()

    def finish(self) -> dict:
        """Write the artifact the proposer loads, plus a summary with the held-out streak."""
        cfg, acc = self.cfg, self.accelerator
        summary = {"steps": self.step, "loss": cfg.loss, "objective": cfg.objective,
                   "trainable_parameters": self.num_trainable, **self.heldout_measures()}
        if acc.is_main_process:
            if self.lora_config is not None:
                path = save_adapter(self.drafter, self.lora_config, self.out / ADAPTER_DIR,
                                    cfg.drafter or cfg.init_from)
                base = self.out / "base"
                if cfg.drafter is None or cfg.init_lora is not None:
                    # The adapter applies to the drafter as initialised: ship that base with it
                    # (a conditioned --drafter run names --init-from too, for its verifier).
                    _save_base_without_lora(self.drafter, base)
                    copy_tokenizer_files(_tokenizer_source(cfg), base)
                    summary["base"] = str(base)
                else:
                    summary["base"] = cfg.drafter
                summary["adapter"] = str(path)
            else:
                summary["model"] = str(save_full(self.drafter, self.out / MODEL_DIR))
                copy_tokenizer_files(_tokenizer_source(cfg), self.out / MODEL_DIR)
            write_json(self.out / "train_summary.json", summary)
        acc.wait_for_everyone()
        return summary


def _truncate_log(path: Path, step: int) -> None:
    """Drop log records past the checkpoint we resume from: those steps are run again."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in kept))


def _save_base_without_lora(drafter: torch.nn.Module, path: Path) -> None:
    """Save the drafter's base weights (LoRA layers unwrapped, not merged)."""
    import copy

    from peft.tuners.lora import LoraLayer

    clone = copy.deepcopy(drafter)
    for name, module in list(clone.named_modules()):
        if isinstance(module, LoraLayer):
            parent_name, _, child = name.rpartition(".")
            parent = clone.get_submodule(parent_name) if parent_name else clone
            setattr(parent, child, module.get_base_layer())
    save_full(clone, path)


def run_train(cfg: TrainConfig) -> dict:
    return Trainer(cfg).run()
