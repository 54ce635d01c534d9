"""The help text of every `specdiff-distill` flag, by config field name: one text per setting,
shared by the command line and the recipe files' field list (`recipe fields`)."""

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
    "styles": "kinds of request and their weights, name:weight comma-separated: open (the plain "
              "empty user turn), category (a system prompt naming one of ten task categories "
              "while the request is written), persona (a system prompt kept in the request), "
              "followup (a second turn after the verifier's answer), rewrite (a kept request "
              "made harder by the verifier); `open` alone is the first packs' recipe",
    "samples_per_prefix": "samples of one category or persona prefix per round",
    "near_duplicate": "drop a request whose word 3-grams overlap a kept one's by this share "
                      "(Jaccard; 1 drops exact repeats only)",
    "answer_tokens": "tokens of the verifier's greedy answer before a follow-up turn (an answer "
                     "that has not ended by then gets no follow-up)",
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
    "add_markov_rank": "--arch conditioned: add a Markov head of this rank (each drafted token "
                       "reads the one before it; its output projection zero, so training starts "
                       "from that drafter's drafts; a new drafter or --drafter DIR without one; "
                       "--finetune full; not servable by vLLM's dflash)",
    "num_taps": "--arch conditioned: verifier layers tapped, spread from layer 1 to N-3",
    "verifier": "verifier model directory",
    "draft_vocab": "reduced-vocabulary table (d2t.safetensors) for --init-from",
    "draft_vocab_size": "train: build that table for --init-from from the data, the N verifier "
                        "ids most frequent in it (saved as OUTPUT/d2t.safetensors); export: "
                        "ship the same kind of table for a run that trained the full head",
    "init_lora": "a LoRA adapter merged into the starting weights",
    "tokenizer": "tokenizer directory the data is checked against (default: beside the drafter)",
    "loss": "streak (default), streak-soft, position-avg, mdm, ce-decay (cross-entropy with "
            "DFlash's position decay exp(-(k-1)/(gamma/2))), dpace (cross-entropy weighted by "
            "the drafter's expected streak from each position on) or kl; streak-soft and kl "
            "read soft targets: the data's, or a conditioned drafter's verifier's top-8",
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
    "tree_budgets": "with --replay: also replay best-first draft trees of these node budgets "
                    "(comma-separated; DDTree's construction from one forward's marginals), and "
                    "the argmax chain cut to each budget below --gamma",
    "replay": "also replay each sequence as greedy serving drafts it (each step right after what "
              "the last one committed; K = 1, T = 0): replay_accepted_per_step predicts the "
              "accepted length serving reports, which random windows overstate",
    "verifier_pass": "run the verifier on the drafts; --no-verifier-pass scores the drafter "
                     "against the data's own tokens only (verifier_token_streak, "
                     "data_greedy_accepted_length: on temperature-1 / greedy data the expected "
                     "accepted length at T = 1 / the greedy one at T = 0), several times cheaper",
}
