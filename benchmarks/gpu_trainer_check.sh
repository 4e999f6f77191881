#!/usr/bin/env bash
# The trainer's GPU checks in one short run, for a lent CUDA machine with torch but no vLLM/Ray:
#   bash benchmarks/gpu_trainer_check.sh OUT_DIR
#   bash benchmarks/gpu_trainer_check.sh --smoke   # on a CPU: a check that it runs (below)
# 1. pytest of the CUDA tests (packed/varlen flash, compile, MoE, device placement, Triton kernels)
#    -> OUT_DIR/gpu_pytest.txt
# 2. benchmarks/trainer_step.py on Qwen3-0.6B's shape (151,936-token vocabulary), bfloat16:
#    padded vs packed vs shared-prompt layouts, eager vs compiled -> OUT_DIR/trainer_step_gpu.jsonl
# Each part has its own time limit so one slow part cannot eat the other's.
# --smoke: OUT_DIR is a fresh temporary folder, pytest only collects the CUDA tests (they need a
# GPU to run), and trainer_step.py runs both calls with --smoke on the CPU (the tiny model; the
# compiled arm's Inductor compile takes ~27 s on 2 cores with a cold cache, ~5 s warm).
# A machine whose Python lacks titanrl's pure-Python needs (the lent H200's image lacks tyro,
# docstring_parser and typeguard) takes them as wheels in .whl/, fetched where pip works:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64 -d .whl tyro docstring-parser typeguard
set -uo pipefail
if [ "${1:-}" = "--smoke" ]; then
  smoke=1 out=$(mktemp -d -t gpu_trainer_check_smoke.XXXXXX)
  trap 'rm -rf "$out"' EXIT
else
  smoke=0 out=${1:?usage: gpu_trainer_check.sh OUT_DIR | --smoke}
fi
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# MKL reads its strict mode at start-up on Intel AVX-512 hosts (titanrl.kernels.mkl_mode)
export MKL_CBWR=AVX2,STRICT
py=${PYTHON:-python3}
# Pure-Python packages titanrl imports that such a machine may lack, carried as wheels in .whl/
if [ -d .whl ]; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  else
    echo "no nvidia-smi"
  fi
  $py -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"
} 2>&1 | tee "$out/gpu_env.txt"

collect=""
[ "$smoke" = 1 ] && collect=--collect-only
timeout 240 $py -m pytest -q -p no:cacheprovider -rs $collect \
  tests/test_trainer_cuda.py tests/test_trainer_device.py tests/test_packed_sequences.py \
  tests/test_kernels_triton.py -m "gpu or not gpu" 2>&1 | tee "$out/gpu_pytest.txt"
pytest_rc=${PIPESTATUS[0]}
echo "pytest exit: $pytest_rc" | tee -a "$out/gpu_pytest.txt"

if [ "$smoke" = 1 ]; then
  step="$py benchmarks/trainer_step.py --smoke --device cpu --dtypes bfloat16 --batch-invariant off"
else
  step="$py benchmarks/trainer_step.py --device cuda --size 0.6b --rows 64 --prompt-len 128 --completion-len 512
    --lengths varied --dtypes bfloat16 --batch-invariant off --repeats 3 --out $out/trainer_step_gpu.jsonl"
fi
timeout 120 $step --layouts padded,packed,shared --compile off 2>&1 | tail -n 20
layouts_rc=${PIPESTATUS[0]}
echo "trainer_step layouts exit: $layouts_rc"
timeout 150 $step --layouts shared --compile off,on 2>&1 | tail -n 20
compile_rc=${PIPESTATUS[0]}
echo "trainer_step compile exit: $compile_rc"
# --smoke fails when a part did; a GPU run reports each part's exit above and goes on.
[ "$smoke" = 0 ] || [ $((pytest_rc + layouts_rc + compile_rc)) = 0 ]
