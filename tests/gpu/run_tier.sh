#!/usr/bin/env bash
# The GPU tier (tests/gpu) as two halves run side by side, so that it fits one 10-minute run on a fresh GPU machine,
# where compiling dominates: half A is the CUDA-graph file, half B everything else. Each half's log goes to
# ${OUT:-/tmp}/gpu_tier_{a,b}.log; the exit status is non-zero when either half fails.
#
#     bash tests/gpu/run_tier.sh            # the same tests as `python -m pytest -q tests/gpu`
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python3}
LOGS=${OUT:-/tmp}
HALF_A=(tests/gpu/test_cuda_graph.py)
start=$(date +%s)
"$PYTHON" -m pytest -q -p no:cacheprovider -rs --durations=8 "${HALF_A[@]}" >"$LOGS/gpu_tier_a.log" 2>&1 &
a=$!
"$PYTHON" -m pytest -q -p no:cacheprovider -rs --durations=8 tests/gpu "${HALF_A[@]/#/--ignore=}" >"$LOGS/gpu_tier_b.log" 2>&1 &
b=$!
wait $a; ra=$?
wait $b; rb=$?
for half in a b; do
    echo "===== half $half"
    tail -n 40 "$LOGS/gpu_tier_$half.log"
done
echo "GPU tier: half A exit $ra, half B exit $rb, $(( $(date +%s) - start )) s wall"
[ $ra -eq 0 ] && [ $rb -eq 0 ]
