# Sourced by the run_*.sh scripts: environment for NCCL on the GPU machines, the log, and `run`, which runs
# one arm under a timeout and keeps only the JSON result lines and errors (also appended to $LOG).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
LOG=${OUT:-/tmp}/${LOG_NAME:-bench}.log
WD=${WATCHDOG:-240}  # bench processes dump their stacks and exit after this many seconds
run() { echo "### $*" | tee -a "$LOG"; timeout -k 10 ${ARM_TIMEOUT:-330} "$@" 2>&1 | grep -E '^\{|Error|error|Traceback|^Thread|^  File|^iteration|^command' | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$LOG"
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)" | tee -a "$LOG"
