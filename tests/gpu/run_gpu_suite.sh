#!/usr/bin/env bash
# Run every CUDA-only test of vime in one command on a CUDA machine (they skip without CUDA).
# Usage: tests/gpu/run_gpu_suite.sh [extra pytest args]   (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
"$PY" - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}, "
      f"devices: {torch.cuda.device_count()}")
try:
    import megatron.core, transformer_engine  # noqa: F401
    print(f"megatron-core {megatron.core.__version__}, transformer_engine present")
except ImportError as exc:
    print(f"note: {exc}")
PY
exec "$PY" -m pytest tests/gpu -v -rs -s "$@"
