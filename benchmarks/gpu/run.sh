#!/usr/bin/env bash
# Every GPU check in one command (a lent GPU machine has no network and little time):
#   the gpu-marked tests (Triton compiled for real, bf16 ASM and memory inception) and the ASM
#   slot-addressing kernel's, then gpu/lse_kernels.py, gpu/mi_profile.py, steering/serving_shapes.py,
#   steering/compile.py, gpu/asm.py, asm/block_ops.py (rows into gpu_asm.jsonl) and
#   air/training_steps.py --device cuda. GPU_TESTS="lse or mixture" (a -k filter), ASM_SECTIONS=decode,
#   MI_MODELS="llama-1b", MI_PATHS="torch auto", MI_SECONDS=150, MI_REPEATS=4, COMPILE_SECONDS=150,
#   SKIP_TESTS=1, SKIP_LSE=1,
#   SKIP_MI=1, SKIP_COMPILE=1, SKIP_PROFILE=1, SKIP_ASM=1, SKIP_TRAINING=1, SKIP_FLA=1 run less. At most 8 files
#   come back from a lent machine: every step's log in one file (steps.log, tables included)
#   and seven JSON-lines files (one a step).
# Wheels the machine's image lacks travel in .whl/ (transformers, datasets and their missing
# needs, flash-linear-attention as an outside anchor); one that does not import there is
# dropped and the run goes on with what the image has. Logs and JSON lines go to $OUT.
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PWD:/tmp/site"
    for module in transformers datasets fla; do
        python3 -c "import $module" 2>"/tmp/import_$module.err" \
            || { echo "# $module from .whl does not import here: dropped"; \
                 rm -rf /tmp/site/"$module" /tmp/site/"$module"-*; }
    done
else
    export PYTHONPATH="$PWD"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print('# torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__)"
step() {  # step SECONDS NAME COMMAND...: run with a time limit, its log appended to steps.log
    local limit=$1 name=$2; shift 2
    echo "## $name"
    local start=$SECONDS log="/tmp/gpu_step_$name.log"
    timeout "$limit" "$@" > "$log" 2>&1
    local rc=$?
    tail -n 40 "$log"
    { echo "## $name: exit $rc after $((SECONDS - start)) s"; cat "$log"; } >> "$OUT/steps.log"
    echo "## $name: exit $rc after $((SECONDS - start)) s"
}
[ "${SKIP_TESTS:-0}" = 1 ] || step 110 gpu_tests python3 -m pytest tests/test_gpu.py tests/test_fused_merge.py tests/test_asm_triton_addressing.py -q -p no:cacheprovider --timeout 100 \
    ${GPU_TESTS:+-k "$GPU_TESTS"}
[ "${SKIP_LSE:-0}" = 1 ] || step 40 gpu_lse python3 -m benchmarks.gpu.lse_kernels --jsonl "$OUT/gpu_lse.jsonl"
[ "${SKIP_PROFILE:-0}" = 1 ] || step 60 gpu_mi_profile python3 -m benchmarks.gpu.mi_profile --jsonl "$OUT/gpu_mi_profile.jsonl"
# shellcheck disable=SC2086  # (MI_MODELS and MI_PATHS are lists)
[ "${SKIP_MI:-0}" = 1 ] || step "${MI_SECONDS:-165}" gpu_mi python3 -m benchmarks.steering.serving_shapes \
    --device cuda --models ${MI_MODELS:-llama-1b smollm2-135m qwen3-moe} \
    --paths ${MI_PATHS:-auto} --repeats "${MI_REPEATS:-2}" --jsonl "$OUT/gpu_mi.jsonl"
# torch.compile with CUDA graphs, plain / steering installed / steered (bf16, launch-bound shape)
[ "${SKIP_COMPILE:-0}" = 1 ] || step "${COMPILE_SECONDS:-240}" gpu_compile python3 -m benchmarks.steering.compile \
    --dtype bfloat16 --mode reduce-overhead --batch 1 --prompt 64 --jsonl "$OUT/gpu_compile.jsonl"
[ "${SKIP_ASM:-0}" = 1 ] || step 200 gpu_asm python3 -m benchmarks.gpu.asm \
    --sections "${ASM_SECTIONS:-layer,model,loss}" --jsonl "$OUT/gpu_asm.jsonl"
# one ASA block's launches and time, fwd + bwd, on the Triton chunk path (rows join gpu_asm.jsonl)
[ "${SKIP_ASM:-0}" = 1 ] || step 60 gpu_block_ops python3 -m benchmarks.asm.block_ops --backend triton_chunk \
    --batch 16 --block 1024 --jsonl "$OUT/gpu_asm.jsonl"
[ "${SKIP_TRAINING:-0}" = 1 ] || step 40 training python3 -m benchmarks.air.training_steps --device cuda \
    --jsonl "$OUT/gpu_training.jsonl"
[ "${SKIP_FLA:-0}" = 1 ] || step 60 gpu_asm_fla python3 -m benchmarks.gpu.asm --sections fla --jsonl "$OUT/gpu_asm_fla.jsonl"
