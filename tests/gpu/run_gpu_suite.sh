#!/usr/bin/env bash
# Every CUDA check of vime in one command, on one CUDA machine with no network:
#   tests/gpu/run_gpu_suite.sh [extra pytest args]        (from anywhere in the repository)
# 1. installs the wheels carried in tests/gpu/wheels/ (see tests/gpu/requirements-offline.txt);
# 2. refuses to run without CUDA (exit 3) or with a missing dependency (exit 4): never a silent
#    all-skipped pass;
# 3. runs tests/gpu: bf16 Megatron step, THD vs mask packing (needs TransformerEngine), CP=2
#    (needs 2 GPUs and TE), each for a Qwen2 and a Qwen3.5 (linear attention on TE's spec),
#    --offload-train bytes freed, optimizer CPU offload and the
#    precision-aware optimizer (TE), MoE EP2 on NCCL (2 GPUs: NCCL refuses two ranks on one
#    device), the trainer-to-engine weight bridge on NCCL (2 GPUs), routing replay (R3) in the
#    bf16 trainer, CUDA vLLM's routed experts replayed by the trainer and vLLM's expert-parallel
#    reload (both need vllm), and the end-to-end `vime train` case, which writes
#    $VIME_GPU_SUITE_OUT/e2e.json (default runs/gpu-suite): reward per rollout, log-prob gap
#    after each sync, generation and training tokens/s, peak memory. Only the TE / 2-GPU / vllm
#    cases may skip (printed with their reason, -rs); any failure fails the script. Budget:
#    about 8 minutes on one H200-class GPU (pytest is capped at $VIME_GPU_SUITE_TIMEOUT,
#    default 540 s). Extra arguments go to pytest, so the suite splits over two shorter calls:
#    `run_gpu_suite.sh -k "not end_to_end"` and `run_gpu_suite.sh -k end_to_end`.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# vLLM in this process (not a subprocess): the weight sync then passes tensors in memory.
export VLLM_ENABLE_V1_MULTIPROCESSING=0
export VIME_GPU_SUITE_OUT="${VIME_GPU_SUITE_OUT:-runs/gpu-suite}"
PY="${PYTHON:-python}"
WHEELS=tests/gpu/wheels
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  echo "run_gpu_suite: installing carried wheels from $WHEELS"
  "$PY" -m pip install -q --no-index --no-deps --find-links "$WHEELS" \
    -r tests/gpu/requirements-offline.txt
fi
"$PY" - <<'PY'
import importlib.util
import sys

import torch

if not torch.cuda.is_available():
    print("run_gpu_suite: no CUDA device visible; this suite needs one", file=sys.stderr)
    sys.exit(3)
needed = ("megatron.core", "mbridge", "transformers", "tokenizers", "safetensors", "einops",
          "jaxtyping", "beartype", "attrs", "matplotlib", "yaml", "tqdm", "pytest", "hypothesis")
missing = [m for m in needed if importlib.util.find_spec(m) is None]
if missing:
    print(f"run_gpu_suite: missing {missing}. Fix: put the wheels of "
          "tests/gpu/requirements-offline.txt in tests/gpu/wheels/ and rerun", file=sys.stderr)
    sys.exit(4)
import megatron.core

optional = {m: importlib.util.find_spec(m) is not None for m in ("transformer_engine", "vllm")}
print(f"run_gpu_suite: torch {torch.__version__}, {torch.cuda.device_count()} x "
      f"{torch.cuda.get_device_name()}, megatron-core {megatron.core.__version__}, optional "
      f"{optional}; e2e engine: {'vllm' if optional['vllm'] else 'hf'}")
PY
mkdir -p "$VIME_GPU_SUITE_OUT"
timeout "${VIME_GPU_SUITE_TIMEOUT:-540}" "$PY" -m pytest tests/gpu -v -rs -s -p no:cacheprovider \
  --junitxml "$VIME_GPU_SUITE_OUT/junit.xml" "$@"
echo "run_gpu_suite: passed; results in $VIME_GPU_SUITE_OUT/e2e.json"
