#!/usr/bin/env bash
# Runs on the GPU machine (carried in .gpu-build/): points the dynamic loader at the CUDA 13
# libraries of the machine's Python environment, then runs the correctness check, tandem's GPU
# benchmark, and the same shapes through PyTorch/transformers for comparison.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
libs=$(python3 - <<'PY'
import os, glob
import nvidia
roots = [os.path.dirname(p) for p in nvidia.__path__]
found = set()
for r in roots:
    for so in glob.glob(os.path.join(r, "nvidia", "**", "lib", "*.so*"), recursive=True):
        found.add(os.path.dirname(so))
print(":".join(sorted(found)))
PY
)
export LD_LIBRARY_PATH="${libs}:/usr/local/cuda/lib64:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
echo "== gpu_check (tiny)"; "$here/gpu_check" --model tiny
echo "== gpu_check (dummy smollm2 shape)"; "$here/gpu_check" --model dummy:smollm2-135m
echo "== gpu_bench"; "$here/gpu_bench"
echo "== PyTorch/transformers, same shapes"; python3 "$here/torch_bench.py"
