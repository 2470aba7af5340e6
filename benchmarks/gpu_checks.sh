#!/usr/bin/env bash
# Checks run on the GPU machine before a benchmark session (results under $OUT/checks/):
# the GPU-marked tests, what this torch's Inductor lowers, and how ncu's NVTX include
# statements and per-launch-config filter behave on a toy script (two named ranges).
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
OUT=${OUT:-$PWD/gpu-out}/checks
mkdir -p "$OUT"
python3 - > "$OUT/inductor.txt" 2>&1 <<'PY'
import inspect, torch
from torch._inductor.kernel.mm import tuned_mm
from torch._inductor.kernel.bmm import tuned_bmm
print(torch.__version__, inspect.signature(tuned_mm), inspect.signature(tuned_bmm))
print("mm overloads", torch.ops.aten.mm.overloads())
PY
timeout 180 python3 -m pytest -p pytest_opprof.plugin -m gpu tests/unit/test_model_graph.py \
  tests/passes/test_pass_gemm_out_dtype.py tests/passes/test_pass_gemm_epilogue.py \
  tests/passes/test_pass_attention_backend.py tests/unit/test_inductor_gpu_work.py \
  tests/unit/test_devicelock.py tests/unit/test_gpu_time.py \
  -q -p no:cacheprovider -rA > "$OUT/gpu-tests.log" 2>&1
echo "gpu tests exit $?" >> "$OUT/gpu-tests.log"
# The backend's reach into Inductor (compile_fx's wiring, freezing, the FX graph cache keying
# folded weights by shape) on this host's torch: CI runs the same tests on the CPU build.
timeout 300 python3 -m pytest -p pytest_opprof.plugin tests/passes/test_backend_compiler.py \
  tests/passes/test_pass_conv_im2col.py tests/passes/test_pass_depthwise_taps.py \
  -q -p no:cacheprovider -rA > "$OUT/torch-internals.log" 2>&1
echo "torch internals tests exit $?" >> "$OUT/torch-internals.log"
cat > /tmp/toy.py <<'PY'
import torch
a = torch.randn(256, 256, device="cuda"); b = torch.randn(64, 64, device="cuda")
torch.cuda.synchronize()
with torch.cuda.nvtx.range("opprof_iteration_eager"):
    for _ in range(3):
        a.mul_(1.0)
    b.add_(1.0)
torch.cuda.synchronize()
with torch.cuda.nvtx.range("opprof_iteration_compiled"):
    for _ in range(2):
        a.mul_(1.0)
    a.add_(1.0)
torch.cuda.synchronize()
PY
for mode in all unique; do
  extra=(--launch-count 40)
  [ "$mode" = unique ] && extra=(--filter-mode per-launch-config --launch-count 1)
  timeout 120 ncu --nvtx --nvtx-include "opprof_iteration_eager/" \
    --nvtx-include "opprof_iteration_compiled/" "${extra[@]}" --metrics gpu__time_duration.sum \
    --csv --page raw --print-units base --log-file "$OUT/toy-$mode.csv" python3 /tmp/toy.py \
    > "$OUT/toy-$mode.out" 2>&1
  echo "exit $?" >> "$OUT/toy-$mode.out"
done
ls -la "$OUT"
