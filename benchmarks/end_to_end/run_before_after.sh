#!/usr/bin/env bash
# Speed of this tree against an older commit's tree, measured alternately in one device call (same machine, same
# warm GPU): OLD=<folder holding the older tree> bash benchmarks/end_to_end/run_before_after.sh
#   make the folder with: mkdir -p _old && git archive <commit> | tar -x -C _old   (and carry it to the device)
# LAYOUTS picks the runs (default: the 1-GPU ones): "tp1 tp1m8" on 1 GPU, add "tp2sp pp2" on 2 GPUs.
LOG_NAME=before_after
source "$(dirname "$0")/_common.sh"
OLD=${OLD:?set OLD to the older tree}
LAYOUTS=${LAYOUTS:-"tp1 tp1m8"}
args_of() {
  case $1 in
    tp1) echo "python3 benchmarks/end_to_end/bench_tp.py ours --watchdog $WD" ;;
    tp1m8) echo "python3 benchmarks/end_to_end/bench_tp.py ours --accumulate 8 --watchdog $WD" ;;
    tp2sp) echo "torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --tp 2 --sp --watchdog $WD" ;;
    pp2) echo "torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --pp 2 --accumulate 8 --watchdog $WD" ;;
    *) echo "unknown layout $1" >&2; exit 2 ;;
  esac
}
for round in 1 2; do
  for layout in $LAYOUTS; do
    cmd=$(args_of "$layout")
    echo "### old $layout (round $round)" | tee -a "$LOG"
    (cd "$OLD" && PYTHONPATH=$PWD timeout -k 10 ${ARM_TIMEOUT:-330} $cmd 2>&1 | grep -E '^\{|Error|Traceback' | tee -a "$LOG")
    echo "### new $layout (round $round)" | tee -a "$LOG"
    timeout -k 10 ${ARM_TIMEOUT:-330} $cmd 2>&1 | grep -E '^\{|Error|Traceback' | tee -a "$LOG"
  done
done
