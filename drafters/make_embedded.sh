#!/usr/bin/env bash
# Rebuilds the embedded default's drafters from nothing: the self-distillation data, the held-out
# answers, the teacher caches, and the DFlash and Domino training runs (recipe: docs/embedded.md).
# Run from the repository root; every stage resumes where an interrupted run stopped, so rerunning
# the same command goes on:
#
#   drafters/make_embedded.sh                  # all stages, in order
#   drafters/make_embedded.sh data heldout     # some stages
#
# The data passes' answers are kept in the repository (drafters/embedded/data/PASS, xz-compressed
# shards and a manifest): `restore` lays them out under $RUNS/data first (with the first-turn pass a
# second-turn pass takes its first answers from), so a pass resumes where the committed data ends,
# and `store` copies the new shards back (commit them).  INIT (a directory with dflash/ and domino/
# drafters, e.g. treespec/assets as shipped: INIT=shipped) warm-starts training from those drafters
# instead of fresh weights.
#
# RUNS (default runs/) holds everything; PASSES (default "greedy turn2 t07 t10 t07b t07c", all six
# committed first-turn passes; turn2t07 and turn2t07b, second turns sampled at T = 0.7 after the
# first answers of the t07 and t07b passes, are committed too and named when wanted) picks the
# passes; THREADS (default 1) sets the threads per command; DEVICE (cpu, the default, or cuda) is
# where the target and the drafters run; BATCH (default 48) is the rows of the data passes'
# continuous batch.  The trained drafters are exported to $RUNS/export/{dflash,domino}; ship
# one by copying it over treespec/assets/smollm2-135m-instruct-KIND/.  For a quick check of the
# pipeline: PROMPTS (training prompts per pass, default 4498) and TRAIN_SET (extra train-drafter
# flags, e.g. "--set steps=20 --set eval_every=10").  MINUTES fits each drafter's training run to that
# many minutes of wall time (`train-drafter --minutes`).  The held-out answers are kept in the
# repository too (drafters/embedded/heldout/SET): `heldout` restores a stored set instead of making
# it, so every session scores on the same held-out answers.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-runs}
passes=${PASSES:-greedy turn2 t07 t10 t07b t07c}
threads=${THREADS:-1}
prompts=${PROMPTS:-4498}
train_set=${TRAIN_SET:-}
device=${DEVICE:-cpu}
batch=${BATCH:-48}
init=${INIT:-}
minutes=${MINUTES:-}
store_dir=drafters/embedded/data
heldout_store=drafters/embedded/heldout
export OMP_NUM_THREADS=$threads
heldout_sets="gsm8k humaneval mt-bench alpaca"

first_turn_of() {  # the pass whose answers a second-turn pass takes as its first answers, if any
  case $1 in
    turn2) echo greedy ;;
    turn2t07) echo t07 ;;
    turn2t07b) echo t07b ;;
  esac
}

pass_args() {  # the distill-data settings of one pass (a second-turn pass: its first answers too)
  local args first
  case $1 in
    greedy) args="" ;;
    turn2) args="--second-turn" ;;
    t07) args="--temperature 0.7 --seed 7" ;;
    t10) args="--temperature 1.0 --seed 10" ;;
    t07b) args="--temperature 0.7 --seed 17" ;;
    t07c) args="--temperature 0.7 --seed 27" ;;
    turn2t07) args="--second-turn --temperature 0.7 --seed 7" ;;
    turn2t07b) args="--second-turn --temperature 0.7 --seed 17" ;;
    *) echo "unknown data pass '$1' (greedy, turn2, t07, t10, t07b, t07c, turn2t07, turn2t07b)" >&2; exit 2 ;;
  esac
  first=$(first_turn_of "$1")
  echo "$args${first:+ --first-answers $runs/data/$first}"
}

restore() {  # the committed answers of each pass and of the first turns it needs, back under $runs/data
  local pass
  for pass in $(for p in $passes; do first_turn_of "$p"; echo "$p"; done | awk '!seen[$0]++'); do
    if [ -f "$store_dir/$pass/manifest.json" ]; then
      treespec data-store restore --store "$store_dir/$pass" --data "$runs/data/$pass"
    fi
  done
}

store() {  # each pass's new shards, and the held-out answers, into the repository's store
  for pass in $passes; do
    if [ -d "$runs/data/$pass" ]; then
      treespec data-store save --data "$runs/data/$pass" --store "$store_dir/$pass"
    fi
  done
  for set in $heldout_sets; do
    if [ -d "$runs/data/heldout-$set" ]; then
      treespec data-store save --data "$runs/data/heldout-$set" --store "$heldout_store/$set"
    fi
  done
}

init_flag() {  # --init of one drafter kind, or nothing for fresh weights
  case $init in
    "") echo "" ;;
    shipped) echo "--init treespec/assets/smollm2-135m-instruct-$1" ;;
    *) echo "--init $init/$1" ;;
  esac
}

data() {  # the target's answers to all 4,498 Alpaca training prompts, one directory per pass
  for pass in $passes; do
    # shellcheck disable=SC2046  # pass_args is a word list
    treespec distill-data --threads "$threads" --device "$device" --num-prompts "$prompts" --batch-size "$batch" \
      --out "$runs/data/$pass" $(pass_args "$pass")
  done
}

heldout() {  # greedy answers to 4 benchmark prompts of each set: scored during training, never trained on
  for set in $heldout_sets; do
    if [ -f "$heldout_store/$set/manifest.json" ]; then  # the committed answers: no benchmark file needed
      treespec data-store restore --store "$heldout_store/$set" --data "$runs/data/heldout-$set"
      continue
    fi
    treespec distill-data --threads "$threads" --device "$device" --dataset "$set" --split bench --num-prompts 4 \
      --max-new-tokens 128 --out "$runs/data/heldout-$set"
  done
}

cache() {  # the frozen target once over every data set: taps and top-32 teacher log-probs
  for name in $passes $(printf 'heldout-%s ' $heldout_sets); do
    treespec teacher-cache --threads "$threads" --device "$device" --data "$runs/data/$name" \
      --out "$runs/teacher/$name"
  done
}

train() {  # both drafters from the same caches and held-out set, best checkpoint by held-out tau exported
  local teachers="" heldouts="" kind
  for pass in $passes; do teachers+=" --teacher $runs/teacher/$pass"; done
  for set in $heldout_sets; do heldouts+=" --heldout $runs/teacher/heldout-$set"; done
  for kind in domino dflash; do
    # shellcheck disable=SC2086  # word lists of flags
    treespec train-drafter $teachers $heldouts --preset "smollm2-$kind-v8k-l1" --threads "$threads" \
      --device "$device" $(init_flag "$kind") ${minutes:+--minutes "$minutes"} $train_set --out "$runs/train/$kind" \
      --export "$runs/export/$kind"
  done
}

for stage in "${@:-restore data store heldout cache train}"; do
  for what in $stage; do "$what"; done
done
