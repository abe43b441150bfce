#!/usr/bin/env bash
# Keras 3 fit and the built-in fit under dd.MirroredStrategy (2 replicas), before vs after a change: the arms of
# benchmarks/keras3_training.py (keras3-dd, builtin-dd, and keras3-plain in one process as the yardstick) run
# from two checkouts, alternating OLD NEW OLD NEW ... in one sitting, the load average printed before each run.
#
# usage: benchmarks/fit_before_after.sh OLD_CHECKOUT [NEW_CHECKOUT (default .)] [PAIRS (default 2)]
#   e.g. git worktree add /tmp/old a19dc50 && benchmarks/fit_before_after.sh /tmp/old . 2
#   env: PYTHON (default python), SAMPLES (default 4096), ROUNDS (rounds inside each run, default 2)
set -euo pipefail
old=$(cd "$1" && pwd)
new=$(cd "${2:-.}" && pwd)
pairs=${3:-2}
python=${PYTHON:-python}
for pair in $(seq "$pairs"); do
  for tree in "$old" "$new"; do
    echo "== pair $pair, $tree: $(uptime)"
    (cd "$tree" && PYTHONPATH="$tree" "$python" benchmarks/keras3_training.py --rounds "${ROUNDS:-2}" \
      --samples "${SAMPLES:-4096}") | grep -E "source:|keras3-dd|builtin-dd|keras3-plain" | grep -v "load before"
  done
done
