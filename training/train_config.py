"""`TrainConfig`: every setting of `train`, and the checks that refuse bad combinations by flag
name before any data or model is loaded (the CLI, the Python API, recipes and the saved
train_config.json all use these names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_specdiff.core import DEFAULT_GAMMA

from .losses import get_loss
from .model import DEFAULT_LORA_TARGETS, check_arch

OBJECTIVES = ("diffusion", "ar")


@dataclass
class TrainConfig:
    data: str
    output: str
    drafter: str | None = None  # an existing drafter directory
    init_from: str | None = None  # or: a causal LM directory -> new block-causal drafter
    num_layers: int = 4  # layers kept by --init-from
    draft_vocab: str | None = None  # d2t table (reduced head) for --init-from
    draft_vocab_size: int | None = None  # or: build that table from the data (N ids)
    init_lora: str | None = None  # an adapter merged into the starting weights
    tokenizer: str | None = None  # tokenizer the data must have been made with
    objective: str = "diffusion"  # diffusion (the drafter's mask block) | ar (a plain causal LM)
    arch: str = "block-causal"  # block-causal | conditioned (see model.ARCHS)
    num_taps: int = 3  # conditioned: verifier layers tapped (spread from 1 to N-3)
    add_layers: int = 0  # conditioned --drafter: new layers appended (zero output: same drafts)
    add_taps: list[int] = field(default_factory=list)  # conditioned --drafter: layers read too
    add_markov_rank: int = 0  # conditioned: a new Markov head of this rank (zero output)
    loss: str = "streak"
    gamma: int = DEFAULT_GAMMA
    drafter_temperature: float = 1.0
    windows_per_seq: int = 8
    batch_size: int = 4
    grad_accum: int = 1
    steps: int = 200
    lr: float = 5e-4
    weight_decay: float = 0.0
    warmup_steps: int = 10
    schedule: str = "cosine"  # cosine | linear | constant (after warm-up)
    max_grad_norm: float = 1.0
    finetune: str = "lora"  # lora | full
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))
    train_params: list[str] = field(default_factory=lambda: [r"."])  # regexes, --finetune full
    freeze_params: list[str] = field(default_factory=lambda: [r"embed_tokens"])
    gradient_checkpointing: bool = False
    mixed_precision: str = "auto"  # auto | no | bf16 | fp16
    heldout_fraction: float = 0.05
    eval_every: int = 0  # steps between held-out streak measurements (0: only at the end)
    eval_windows: int = 256
    save_every: int = 100
    max_length: int | None = None
    min_context: int = 1
    seed: int = 0
    resume: bool = True

    def validate(self) -> None:
        get_loss(self.loss)
        for name in ("gamma", "windows_per_seq", "batch_size", "grad_accum", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.drafter_temperature <= 0:
            raise ValueError("--drafter-temperature must be > 0")
        if self.finetune not in ("lora", "full"):
            raise ValueError(f"--finetune must be lora or full, got {self.finetune!r}")
        if self.schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"--schedule must be cosine, linear or constant, "
                             f"got {self.schedule!r}")
        if self.mixed_precision not in ("auto", "no", "bf16", "fp16"):
            raise ValueError("--mixed-precision must be auto, no, bf16 or fp16")
        if self.save_every < 1:
            raise ValueError("--save-every must be >= 1")
        self._validate_objective()
        self._validate_arch()
        if self.draft_vocab_size is not None:
            if self.draft_vocab is not None or self.init_from is None:
                raise ValueError("--draft-vocab-size builds the reduced head for --init-from; "
                                 "do not combine it with --draft-vocab or --drafter")
            if self.draft_vocab_size < 1:
                raise ValueError("--draft-vocab-size must be >= 1")

    def _validate_arch(self) -> None:
        check_arch(self.arch)
        if self.add_layers < 0:
            raise ValueError("--add-layers must be >= 0")
        if self.add_layers and (self.arch != "conditioned" or self.drafter is None):
            raise ValueError("--add-layers deepens a trained conditioned drafter: use it with "
                             "--arch conditioned --drafter DIR")
        try:
            self.add_taps = [int(t) for t in self.add_taps]  # the command line gives strings
        except ValueError:
            raise ValueError(f"--add-taps takes verifier layer numbers (e.g. 8,20), got "
                             f"{','.join(map(str, self.add_taps))}") from None
        if self.add_taps and (self.arch != "conditioned" or self.drafter is None):
            raise ValueError("--add-taps widens a trained conditioned drafter: use it with "
                             "--arch conditioned --drafter DIR")
        self._validate_markov()
        if self.arch == "block-causal":
            return
        if self.num_taps < 1:
            raise ValueError("--num-taps must be >= 1")
        if self.init_from is None:
            raise ValueError("--arch conditioned reads the verifier given by --init-from (its "
                             "embedding, head and features); --drafter DIR starts from a "
                             "trained conditioned drafter instead of new layers")
        if self.drafter is not None and (self.draft_vocab or self.draft_vocab_size):
            raise ValueError("--arch conditioned --drafter keeps that drafter's head: drop "
                             "--draft-vocab / --draft-vocab-size")
        if self.objective != "diffusion" or self.init_lora:
            raise ValueError("--arch conditioned trains with --objective diffusion and no "
                             "--init-lora")
        if self.finetune != "full" and self.drafter is None:
            # LoRA on new, random, frozen layers would train next to nothing
            raise ValueError("--arch conditioned trains new layers with --finetune full; "
                             "--finetune lora adapts a trained conditioned drafter given by "
                             "--drafter DIR")

    def _validate_markov(self) -> None:
        if self.add_markov_rank < 0:
            raise ValueError("--add-markov-rank must be >= 0")
        if self.add_markov_rank and (self.arch != "conditioned" or self.finetune != "full"):
            # LoRA would leave the new head frozen at zero (and outside the adapter)
            raise ValueError("--add-markov-rank adds a Markov head to a conditioned drafter (a "
                             "new one from --init-from, or a trained one given by --drafter "
                             "DIR): use it with --arch conditioned --finetune full")

    def _validate_objective(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"--objective must be {' or '.join(OBJECTIVES)}, "
                             f"got {self.objective!r}")
        if self.objective != "ar":
            return
        if self.finetune != "full":
            raise ValueError("--objective ar trains with --finetune full (vLLM's draft_model "
                             "loads merged weights)")
        unsupported = [flag for flag, value in (("--draft-vocab", self.draft_vocab),
                                                ("--draft-vocab-size", self.draft_vocab_size),
                                                ("--init-lora", self.init_lora))
                       if value is not None]
        if unsupported:
            raise ValueError(f"--objective ar does not support {', '.join(unsupported)} "
                             f"(vLLM's draft_model needs the verifier's full vocabulary)")
