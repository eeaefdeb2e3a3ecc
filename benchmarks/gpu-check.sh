#!/bin/bash
# The project's GPU check, for a machine with an NVIDIA GPU whose python3 has CUDA torch and
# the project's dependencies (pluggy, typer, python-hostlist; pytest and pytest-xdist for the
# tests; matplotlib for the chart, else it is left out). No network needed: wheels in
# $WHEELS (default: benchmarks/whl, else .device/whl) are installed first. From the
# project's root:
#   bash benchmarks/gpu-check.sh [smoke] [tests] [bench]      (none: all three, in this order)
#   smoke   benchmarks/gpu_smoke.py, under 5 minutes on one GPU: what a CPU cannot show of the
#           memory checkpoint arena's CUDA path, one PASS/FAIL/SKIP line per case (fused
#           AdamW and BatchNorm with a save every step, the default AdamW's step not held up;
#           20 DCP saves leaking no descriptor nor pinned range; a refused pin leaving no
#           CUDA error; a worker of GPU 1 making no context on GPU 0; an asynchronous save
#           committed when the script ends at once)
#   tests   the arena's, asynchronous copies', loads', DCP's, warm start's, warm workers' random state's and saves on notice's
#           tests, CUDA ones included;
#           examples/dcp_train.py (FSDP2 on the GPU, DCP into the memory tier) failing once
#   bench   benchmarks/bench_gpu.py: writes benchmarks/results/gpu.json and docs/benchmarks-gpu.md
# Logs and the written files go to $OUT (default /tmp/gpu-check). Every step is bounded. All
# it writes to /dev/shm goes to one folder there, removed at the end (an agent's memory
# directory of a job killed on its timeout too).
set -u
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/gpu-check}; mkdir -p "$O"
D=$(cd "$(dirname "$0")" && pwd)
parts=" ${*:-smoke tests bench} "
T0=$(date +%s)
say() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }

SHM=$(mktemp -d /dev/shm/rallypoint-gpu-check.XXXXXX) || { echo "FAIL no folder in /dev/shm"; exit 1; }
export GPU_CHECK_SHM=$SHM
before=$(ls /dev/shm)
cleanup() {  # the folder, and a memory directory an agent killed on a timeout left behind
  rm -rf "$SHM"
  comm -13 <(echo "$before" | sort) <(ls /dev/shm | sort) | grep '^rallypoint-' |
    while read -r left; do [ -O "/dev/shm/$left" ] && rm -rf "/dev/shm/$left"; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

timeout 60 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 120 python3 -c "import torch; assert torch.cuda.is_available(); print('torch', torch.__version__, 'cuda', torch.version.cuda)" || { echo "FAIL no CUDA"; exit 1; }
for whl in "${WHEELS:-}" "$D/whl" .device/whl; do
  if [ -n "$whl" ] && compgen -G "$whl/*.whl" >/dev/null; then
    timeout 300 python3 -m pip install -q --no-index --no-deps "$whl"/*.whl >"$O/pip.log" 2>&1 ||
      { echo "FAIL install the wheels of $whl: $(tail -1 "$O/pip.log")"; exit 1; }
    break
  fi
done
timeout 300 python3 -m pip install -q --no-index --no-deps --no-build-isolation . >>"$O/pip.log" 2>&1 || { echo "FAIL install: $(tail -1 "$O/pip.log")"; exit 1; }
# Wherever pip put the command: on PATH, else the module of the python3 it installed into.
RP=(rallypoint); command -v rallypoint >/dev/null || RP=(python3 -m rallypoint)
timeout 60 "${RP[@]}" --version >/dev/null 2>&1 || { echo "FAIL rallypoint does not start: $(timeout 60 "${RP[@]}" --version 2>&1 | tail -1)"; exit 1; }

if [[ $parts == *" smoke "* ]]; then
  # The cases share 270 s (gpu_smoke.py's BUDGET); this bounds the whole part below 5 minutes.
  timeout -k 5 290 python3 benchmarks/gpu_smoke.py --shm "$SHM" 2>"$O/smoke.err" | tee "$O/smoke.log"
  rc=${PIPESTATUS[0]}
  echo "smoke exit $rc: $(grep -c '^PASS' "$O/smoke.log") passed, $(grep -c '^FAIL' "$O/smoke.log") failed, $(grep -c '^SKIP' "$O/smoke.log") skipped"
  say smoke done
fi

if [[ $parts == *" tests "* ]]; then
  timeout 420 python3 -m pytest -p no:cacheprovider -q -rs -n 4 tests/test_arena.py \
    tests/test_copying.py tests/test_loading.py tests/test_dcp.py tests/test_warm_random.py tests/test_warm_start.py tests/test_save_notice.py \
    >"$O/pytest-gpu.log" 2>&1
  echo "GPU tests exit $?: $(tail -1 "$O/pytest-gpu.log")"
  grep -E "^(FAILED|ERROR|SKIPPED)" "$O/pytest-gpu.log" | head -20
  # One rank (NCCL takes one GPU per rank): it fails at step 20 and resumes from memory.
  timeout 300 "${RP[@]}" run --nproc-per-node 1 --max-restarts 1 --checkpoint-memory 1GB \
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
