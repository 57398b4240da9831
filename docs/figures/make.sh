#!/usr/bin/env bash
# Regenerates every figure and table the docs show, from the embedded default (SmolLM2-135M-Instruct
# and the drafters shipped in treespec/assets/).  Run from the repository root:
#
#   docs/figures/make.sh trees    # the drawn trees of docs/policies/ (about a minute)
#   docs/figures/make.sh ab       # the A/B walkthrough's bench run (docs/ab-walkthrough.md; about 12 min on 2 CPU cores)
#   docs/figures/make.sh sweep    # docs/replay.md's sweep, side-by-side trees and trace page (5 min; needs chromium)
#   docs/figures/make.sh rules    # docs/tree-rules.md: the held-out trace, its records and the two drawings (25 min)
#
# Trees: the same chat prompt and the same decoding round for every policy, so the pages compare.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=docs/figures
prompt="Name the three primary colors."
round=3

trees() {
  # bf16 and a named cost model for the cost-aware methods: the figures do not depend on the machine
  for spec in "chain dflash" "chain-domino domino" "ddtree ddtree@16" "caddtree caddtree@64" \
              "dominotree dominotree@16" "static-corrected static-corrected@16" \
              "cost-aware-dominotree cost-aware-dominotree@64" "eagle2 eagle2@16" "static static" \
              "sequoia sequoia@16" "hardware-aware-sequoia hardware-aware-sequoia@64" \
              "pruned-dominotree pruned-dominotree@16" "learned-ddtree learned-ddtree@16" \
              "learned-dominotree learned-dominotree@16" "confident-ddtree confident-ddtree@16" \
              "confident-dominotree confident-dominotree@16" "gap-ddtree gap-ddtree@16" "router router@16"; do
    set -- $spec
    treespec draw --method "$2" --prompt "$prompt" --round $round --title "$2, round $round" --overwrite \
      --dtype bfloat16 --cost-model preset:smollm2-cpu-bf16 --out "$out/tree-$1.svg"
  done
  treespec draw --method dominotree@16 --prompt "$prompt" --round $round --dtype bfloat16 --overwrite \
    --out "$out/tree-dominotree.mmd"
}

ab() {
  # one rank per core, one thread each: on the 2-core CPU of the docs a second thread does not speed
  # one float32 process (AR 18.9 against 18.7 tokens/s), so two ranks do nearly twice the work; the
  # methods of a prompt turn still run side by side in one rank
  OMP_NUM_THREADS=1 torchrun --nproc_per_node "${RANKS:-2}" -m treespec.apps.cli bench --methods ar,dflash,domino,ddtree,caddtree,dominotree,static-corrected --budgets 16,64 \
    --temperatures 0,1 --datasets gsm8k,mt-bench,humaneval,alpaca --prompts 2 --max-new-tokens 64 \
    --seed 0 --dtype float32 --out "$out/ab"
}

rules() {
  # the tree rules past DominoTree, replayed on held-out prompts (benchmarks/bench_tree_rules.py)
  trace=runs/trace-rules.safetensors
  [ -f "$trace" ] || python benchmarks/bench_tree_rules.py record --out "$trace"
  python benchmarks/bench_tree_rules.py eval "$trace" --out "$out/rules/records.json"
  methods="dominotree@16,pruned-dominotree@16+rule=ratio+ratio=4.0"
  treespec draw --trace "$trace" --methods "$methods" --prompt 0 --position 40 --overwrite \
    --title "where pruning by ratio hurts (gsm8k, position 40)" --out "$out/rules/hurts.svg"
  treespec draw --trace "$trace" --methods "$methods" --prompt 0 --position 44 --overwrite \
    --title "where pruning by ratio helps (gsm8k, position 44)" --out "$out/rules/helps.svg"
}

sweep() {
  # a 20-prompt trace (5 each of GSM8K, HumanEval, MT-Bench, Alpaca; 64 tokens), replayed and drawn
  trace=runs/trace-docs.safetensors
  [ -f $trace ] || treespec replay record --out $trace --dataset gsm8k --dataset humaneval --dataset mt-bench \
    --dataset alpaca --limit 5 --max-new-tokens 64 --threads 1
  treespec replay eval $trace --methods ddtree,eagle2,dominotree --budgets 4,8,16,32,64 --set topk=2,4,10 \
    --baseline ddtree --out $out/sweep --overwrite
  rm -f $out/sweep/budget_curves.png  # the SVG is the doc's
  treespec draw --trace $trace --prompt 8 --position 20 --methods ddtree@16,eagle2@16 --out $out/side-by-side.svg --overwrite \
    --html runs/trace-page.html
  chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1400,820 \
    --screenshot=$out/trace-page.png "file://$PWD/runs/trace-page.html#position=20"
}

for what in "${@:-trees}"; do "$what"; done
