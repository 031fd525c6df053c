#!/usr/bin/env bash
# GPU serving check (see bench/gpu.py): builds the full preset with random weights on the GPU, checks it
# against CPU float32, times the batched generator step at 1..256 streams with SDPA and FlashInfer,
# counts the host syncs and bytes to the host per generator step (budget 1, the stop decision; with Instruct
# text-phase rows 2, and 8 bytes a text row: its token id), and prints one markdown table.
# Needs a CUDA build of PyTorch >= 2.11; no internet, no tritonserver.
#   bench/gpu.sh                 # the full run (a few minutes)
#   bench/gpu.sh --smoke         # tiny preset, 1-2 streams, CPU if there is no GPU (seconds)
#   bench/gpu.sh --syncs-only    # only the host syncs per step (seconds); --device cpu: on the meta device
#   bench/gpu.sh --triton        # also the open-loop ceiling of the full preset's real networks through
#                                # tritonserver, when one is installed (bench.ceiling --real; all in 8 min)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
cpu_ok=0
for a in "$@"; do case "$a" in --smoke|--syncs-only) cpu_ok=1 ;; esac; done
"$PY" - "$cpu_ok" <<'PYEOF'
import sys, torch
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
if (major, minor) < (2, 11):
    sys.exit(f"PyTorch {torch.__version__} found; bench/gpu.sh needs >= 2.11")
if sys.argv[1] == "0" and not torch.cuda.is_available():
    sys.exit("no CUDA device visible to PyTorch (--smoke checks the script on CPU, --syncs-only --device cpu the syncs)")
PYEOF
exec timeout "${GPU_BENCH_TIMEOUT:-480}" "$PY" -m bench.gpu "$@"
