"""`specdiff-distill`: generate verifier data, streak-distil a drafter, evaluate it.

    specdiff-distill corpus --output prompts.jsonl --heldout-output chat_heldout.jsonl
    specdiff-distill self-prompts --verifier DIR --output self.jsonl --num-prompts 2000
    specdiff-distill generate --verifier DIR --prompts prompts.jsonl --output data/
    specdiff-distill train --data data/ --drafter DRAFTER_DIR --output runs/streak
    specdiff-distill eval --data data/ --verifier DIR --candidate base=DRAFTER_DIR \\
        --candidate runs/streak --output runs/eval.json
    specdiff-distill datastore --data data/ --output datastore.safetensors

Options mirror the fields of GenerateConfig / TrainConfig / EvalConfig (one flag per field), so
the CLI, the Python API and the saved train_config.json all use the same names.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import warnings
from collections.abc import Sequence
from typing import Any

HELP = {
    # corpus
    "heldout_output": "also write general chat prompts on held-out topics here (benchmarks)",
    "num_code": "code requests made from installed Python source",
    "num_chat": "general chat instructions (templates x training topics)",
    "num_heldout": "held-out chat prompts written to --heldout-output",
    "code_tasks": "comma-separated kinds of code request: complete (a signature and docstring "
                  "to complete), explain, fix, test, write, rewrite, annotate",
    "exclude": "comma-separated corpus files (JSONL) whose prompts this corpus does not repeat",
    "more_topics": "also draw the training chat from ~190 more topics and 12 more templates (never "
                   "held out; off keeps earlier seeds' corpora reproducible)",
    "extra_topics": "also draw the training chat from a third pool of ~230 topics and 16 templates "
                    "(never held out; off keeps earlier seeds' corpora reproducible)",
    "source_roots": "comma-separated directories of Python source (default: this interpreter's "
                    "standard library and site-packages)",
    # self-prompts
    "num_prompts": "requests to keep (sampling goes on until this many pass the filter)",
    "min_words": "drop requests of fewer words",
    "max_request_tokens": "drop requests that have not ended their turn within this many tokens",
    "samples_per_round": "requests sampled per call (one seeded request; vLLM seeds its samples "
                         "apart)",
    "max_rounds": "give up (with a warning) after this many times --num-prompts / "
                  "--samples-per-round sampling calls",
    "benchmark_prompts": "comma-separated prompt sources (built-in sets or .jsonl) whose "
                         "8-word runs a kept request must not share",
    # generate
    "prompts": "jsonl: one prompt per line (string, {'prompt'|'text': str} or {'messages': [...]})",
    "num_samples": "continuations per prompt",
    "temperature": "verifier sampling temperature (1.0 = the paper's setting; 0 = greedy)",
    "max_new_tokens": "tokens generated per continuation",
    "top_logprobs": "also store the verifier's top-k log-probs per generated position "
                    "(soft targets for streak-soft/kl; 0 = off)",
    "chunk_size": "prompts per shard (the unit of resumption)",
    "batch_size": "prompts per generate call (generate) / sequences per micro-batch (train) / "
                  "held-out sequences per drafter and verifier call (eval)",
    "backend": "auto (vLLM when installed), vllm or transformers",
    "max_prompts": "use only the first N prompts",
    "max_prompt_tokens": "keep the last N tokens of longer prompts",
    "chat_template": "wrap text prompts as a user message with the tokenizer's chat template",
    "dtype": "auto (bf16 on GPUs that have it, else float32), float32, bfloat16, float16",
    "device": "auto, cpu, cuda, cuda:N",
    # train
    "data": "data directory written by `generate`, or several separated by commas (a "
            "resumed run may append directories)",
    "output": "output directory (train) / JSON file (eval, curves; a PNG is written beside it) / "
              "prompt jsonl (corpus) / slim drafter directory (export) / datastore file "
              "(datastore)",
    "drafter": "drafter directory: to train (e.g. the default block-causal drafter), or to "
               "export (a conditioned drafter, --format dflash)",
    "format": "specdiff (the plugin's drafter directory) or dflash (a checkpoint vLLM's own "
              "`dflash` method serves: --speculative-config '{\"method\": \"dflash\", ...}')",
    "init_from": "or: a Llama/Qwen2 causal LM directory to build a block-causal drafter from "
                 "(--objective ar: the causal LM truncated to --num-layers)",
    "objective": "diffusion (the drafter's mask block) or ar (a plain autoregressive LM, the "
                 "baseline drafter of vLLM's draft_model method; needs --finetune full)",
    "num_layers": "decoder layers kept by --init-from (--arch conditioned: drafter layers)",
    "arch": "block-causal (a drafter that sees token ids only) or conditioned (reads the "
            "verifier's hidden states, DFlash-style; --init-from names the verifier)",
    "add_layers": "--arch conditioned --drafter: append this many new layers (their output "
                  "projections zero, so training starts from that drafter's acceptance)",
    "add_taps": "--arch conditioned --drafter: comma-separated verifier layers to read too (their "
                "feature-projection columns zero, so training starts from that drafter)",
    "num_taps": "--arch conditioned/injected: verifier layers tapped, spread from layer 1 to N-3",
    "verifier": "verifier model directory (generate; train --arch injected: the verifier whose "
                "hidden states the drafter reads)",
    "draft_vocab": "reduced-vocabulary table (d2t.safetensors) for --init-from",
    "draft_vocab_size": "train: build that table for --init-from from the data, the N verifier "
                        "ids most frequent in it (saved as OUTPUT/d2t.safetensors); export: "
                        "ship the same kind of table for a run that trained the full head",
    "init_lora": "a LoRA adapter merged into the starting weights",
    "tokenizer": "tokenizer directory the data is checked against (default: beside the drafter)",
    "loss": "streak (default), streak-soft, position-avg, mdm, ce-decay (cross-entropy with "
            "DFlash's position decay exp(-(k-1)/(gamma/2))) or kl",
    "gamma": "draft window (tokens per draft)",
    "drafter_temperature": "drafter softmax temperature T_d (the plugin's drafter_temperature)",
    "windows_per_seq": "windows packed per sequence (one context pass serves them all)",
    "grad_accum": "micro-batches per optimizer step",
    "steps": "optimizer steps",
    "lr": "peak learning rate (AdamW)",
    "weight_decay": "AdamW weight decay",
    "warmup_steps": "linear warm-up steps",
    "schedule": "after warm-up: cosine, linear or constant",
    "max_grad_norm": "gradient clipping (0 = off)",
    "finetune": "lora (a PEFT adapter) or full (merged weights of --train-params)",
    "lora_rank": "LoRA rank",
    "lora_alpha": "LoRA alpha",
    "lora_dropout": "LoRA dropout",
    "lora_targets": "comma-separated linear module names that get LoRA",
    "train_params": "comma-separated regexes of parameters trained by --finetune full",
    "freeze_params": "comma-separated regexes never trained by --finetune full",
    "gradient_checkpointing": "recompute decoder layers in backward (less memory)",
    "mixed_precision": "auto (bf16 where the hardware has it, else fp32), no, bf16, fp16",
    "heldout_fraction": "fraction of prompts held out, split by prompt (eval: by default the "
                        "fraction the candidates were trained with)",
    "eval_every": "steps between held-out expected-streak measurements (0: only at the end)",
    "eval_windows": "held-out windows measured by train",
    "save_every": "steps between checkpoints",
    "max_length": "longest sequence prefix used (context + gamma)",
    "min_context": "shortest context a window may have",
    "seed": "random seed (data order, sampling, initialisation)",
    "resume": "continue from the latest checkpoint in --output",
    # export
    "runs": "comma-separated `train` output directories to draw side by side",
    "run": "a `train` output directory (its latest checkpoint) or one checkpoint directory",
    # eval
    "candidates": "[NAME=]PATH[+ADAPTER]: a drafter directory, a `train` output directory, or a "
                  "drafter plus an adapter; repeat to compare side by side",
    "verifier_temperature": "temperature of the verifier's p in the expected accepted length",
    "num_drafts": "drafts K sampled per window (K > 1 also reports the self-selected max; the "
                  "plugin's num_drafts)",
    "max_windows": "held-out windows evaluated",
    "split": "heldout (the prompts train held out) or all",
    "plot": "write the per-position acceptance PNG",
    "replay": "also replay each sequence as greedy serving drafts it (each step right after what "
              "the last one committed; K = 1, T = 0): replay_accepted_per_step predicts the "
              "accepted length serving reports, which random windows overstate",
    "verifier_pass": "run the verifier on the drafts; --no-verifier-pass scores the drafter "
                     "against the data's own tokens only (verifier_token_streak, "
                     "data_greedy_accepted_length: on temperature-1 / greedy data the expected "
                     "accepted length at T = 1 / the greedy one at T = 0), several times cheaper",
}
SINGULAR = {"candidates": "candidate"}
# old flags, still accepted with a warning: field -> flags
DEPRECATED = {"drafter_temperature": ("--draft-temperature",)}
REQUIRED = {"corpus": {"output"}, "self-prompts": {"verifier", "output"},
            "generate": {"verifier", "prompts", "output"},
            "train": {"data", "output"}, "eval": {"data", "verifier", "candidates"},
            "export": {"verifier", "output"}, "datastore": {"data", "output"},
            "curves": {"runs", "output"}}


def _add_fields(parser: argparse.ArgumentParser, cls: type, required: set[str]) -> None:
    """One flag per dataclass field; its default and type come from the dataclass."""
    for f in dataclasses.fields(cls):
        flag = "--" + SINGULAR.get(f.name, f.name).replace("_", "-")
        kw: dict[str, Any] = {"dest": f.name, "help": HELP.get(f.name, "")}
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        t = str(f.type)
        if f.name == "candidates":
            kw.update(action="append", default=[])
        elif t == "bool":
            kw.update(action=argparse.BooleanOptionalAction, default=default)
        elif t.startswith("list"):
            kw.update(type=lambda s: [x for x in s.split(",") if x], default=default)
        else:
            base = t.replace(" | None", "")
            kw.update(type={"int": int, "float": float}.get(base, str), default=default)
        if f.name in required:
            kw["required"] = True
            kw.pop("default", None)
        kw["help"] += "" if default in (None, [], "") or kw.get("required") else \
            f" (default: {','.join(default) if isinstance(default, list) else default})"
        parser.add_argument(flag, **kw)
        for old in DEPRECATED.get(f.name, ()):
            parser.add_argument(old, dest=f.name, type=kw["type"], action=_Deprecated,
                                metavar=flag, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


class _Deprecated(argparse.Action):
    """An old spelling of a flag: stores like the new one, and warns."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        warnings.warn(f"{option_string} is deprecated; use {self.metavar}", FutureWarning,
                      stacklevel=2)
        setattr(namespace, self.dest, values)


def build_parser() -> argparse.ArgumentParser:
    from .corpus import CorpusConfig
    from .curves import CurvesConfig
    from .datastore import DatastoreConfig
    from .evaluate import EvalConfig
    from .export import ExportConfig
    from .generate import GenerateConfig
    from .self_prompts import SelfPromptsConfig
    from .trainer import TrainConfig

    parser = argparse.ArgumentParser(prog="specdiff-distill", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, cls, desc in (
            ("corpus", CorpusConfig, "build a training prompt corpus (installed Python source + "
                                     "chat instructions)"),
            ("self-prompts", SelfPromptsConfig, "chat requests written by the verifier "
                                                "itself, benchmark material dropped"),
            ("generate", GenerateConfig, "prompts -> verifier continuations (token-id shards)"),
            ("train", TrainConfig, "streak-distil a drafter on verifier sequences"),
            ("eval", EvalConfig, "accepted lengths and acceptance curves against the verifier"),
            ("export", ExportConfig, "a full fine-tuning run -> slim drafter directory + its "
                                     "learning curve"),
            ("datastore", DatastoreConfig, "verifier data -> a retrieval datastore file (the "
                                           "training split's continuations)"),
            ("curves", CurvesConfig, "training runs' held-out learning curves side by side "
                                     "(JSON + PNG)")):
        p = sub.add_parser(name, help=desc, description=desc)
        _add_fields(p, cls, REQUIRED[name])
        p.set_defaults(config_cls=cls)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    cls = args.config_cls
    names = {f.name for f in dataclasses.fields(cls)}
    cfg = cls(**{k: v for k, v in vars(args).items() if k in names})
    try:
        if args.command == "corpus":
            from .corpus import run_corpus

            result = run_corpus(cfg)
        elif args.command == "self-prompts":
            from .self_prompts import run_self_prompts

            result = run_self_prompts(cfg)
        elif args.command == "generate":
            from .generate import run_generate

            result = run_generate(cfg)
        elif args.command == "train":
            from .trainer import run_train

            result = run_train(cfg)
        elif args.command == "export":
            from .export import run_export

            result = run_export(cfg)
        elif args.command == "curves":
            from .curves import run_curves

            result = run_curves(cfg)
        elif args.command == "datastore":
            from .datastore import run_datastore

            result = run_datastore(cfg)
        else:
            from .evaluate import run_eval

            result = run_eval(cfg)
            result = {"output": cfg.output, "results": {
                k: {m: v[m] for m in ("expected_accepted_length", "greedy_accepted_length",
                                      "expected_accepted_length_selected",
                                      "verifier_token_streak", "data_greedy_accepted_length",
                                      "windows")}
                for k, v in result["results"].items()}}
    except (ValueError, FileNotFoundError) as e:
        print(f"specdiff-distill {args.command}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
