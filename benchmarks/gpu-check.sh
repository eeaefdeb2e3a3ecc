#!/bin/bash
# The project's GPU check, for a machine with one NVIDIA GPU whose python3 has CUDA torch and
# the project's dependencies (pluggy, typer, python-hostlist; pytest and pytest-xdist for the
# tests; matplotlib for the chart, else it is left out). From the project's root:
#   bash benchmarks/gpu-check.sh [tests] [bench]      (none: both)
#   tests   the arena's, warm start's, warm workers' random state's and saves on notice's
#           tests, CUDA ones included;
#           examples/dcp_train.py (FSDP2 on the GPU, DCP into the memory tier) failing once
#   bench   benchmarks/bench_gpu.py: writes benchmarks/results/gpu.json and docs/benchmarks-gpu.md
# Logs and the written files go to $OUT (default /tmp/gpu-check). Every step is bounded.
set -u
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/gpu-check}; mkdir -p "$O"
parts=" ${*:-tests bench} "
T0=$(date +%s)
say() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; assert torch.cuda.is_available(); print('torch', torch.__version__, 'cuda', torch.version.cuda)" || { echo "FAIL no CUDA"; exit 1; }
python3 -m pip install -q --no-deps --no-build-isolation . >"$O/pip.log" 2>&1 || { echo "FAIL install: $(tail -1 "$O/pip.log")"; exit 1; }

if [[ $parts == *" tests "* ]]; then
  timeout 420 python3 -m pytest -p no:cacheprovider -q -rs -n 4 tests/test_arena.py \
    tests/test_warm_random.py tests/test_warm_start.py tests/test_save_notice.py \
    >"$O/pytest-gpu.log" 2>&1
  echo "GPU tests exit $?: $(tail -1 "$O/pytest-gpu.log")"
  grep -E "^(FAILED|ERROR|SKIPPED)" "$O/pytest-gpu.log" | head -20
  # One rank (NCCL takes one GPU per rank): it fails at step 20 and resumes from memory.
  timeout 300 rallypoint run --nproc-per-node 1 --max-restarts 1 --checkpoint-memory 1GB \
    --checkpoint-dir "$O/dcp" examples/dcp_train.py --steps 40 --crash-at 20 --crash-rank 0 \
    >"$O/dcp-train.log" 2>&1
  echo "dcp_train exit $?: $(grep -c 'resumed from step 19 (memory)' "$O/dcp-train.log") resumed from memory"
  say tests done
fi

if [[ $parts == *" bench "* ]]; then
  timeout 1500 python3 benchmarks/bench_gpu.py >"$O/bench-gpu.log" 2>&1
  echo "bench_gpu exit $?"; tail -3 "$O/bench-gpu.log"
  cp benchmarks/results/gpu.json docs/benchmarks-gpu.md "$O/" 2>/dev/null
  cp docs/img/bench_gpu_stall.png "$O/" 2>/dev/null
  say bench done
fi
