#!/usr/bin/env bash
# Every GPU measurement the docs still hold open, in one run of at most about nine minutes on one H100 or H200, each
# part's figures written as soon as it ends (REPORT_DIR, default $OUT or runs/gpu_check/):
#   smolvla.txt   SmolVLA at smolvla_base's shapes (bench/smolvla_gpu.py): the chunk decision at 1/16/64 envs on the
#                 eager path and the CUDA graph, each again with fused attention; the recipe's update over 512 decisions
#                 with its peak memory; the same update with fused attention; with the actors' vision-tower tokens in
#                 place of the frames; the learner group's path with one rank against the learner alone.
#   compiled.txt  the decision at 16 envs with its denoising steps and vision tower compiled, plain and fused (in the
#                 time the first part leaves; a part cut short keeps the stages it finished in gpu_check.log).
#   gpu_check.log every part's progress and errors.
#
#     bash bench/gpu_check.sh           # on the GPU machine (MUJOCO_GL=egl; wheels from .whl/ when that folder exists)
#     bash bench/gpu_check.sh --tiny    # the same parts at test size on CPU, with this machine's packages
set -uo pipefail
cd "$(dirname "$0")/.."

size=full
[ "${1:-}" = "--tiny" ] && size=tiny
report_dir=${REPORT_DIR:-${OUT:-runs/gpu_check}}
mkdir -p "$report_dir"
log=$report_dir/gpu_check.log
budget_seconds=${GPU_CHECK_SECONDS:-540}  # the whole check; the compiled paths get what the first part leaves
parts=${GPU_CHECK_PARTS:-smolvla compiled}  # which parts run
python=${PYTHON:-python3}  # the interpreter that holds torch
export MUJOCO_GL=${MUJOCO_GL:-egl} PYOPENGL_PLATFORM=${PYOPENGL_PLATFORM:-egl} PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the checkout, where the project is not installed (a bare GPU machine)

note() { echo "[gpu_check] $*" | tee -a "$log" >&2; }

if [ "$size" = full ] && [ -d .gl ]; then  # EGL loaders a bare GPU image may lack (their .debs fetched beside the tree)
    for deb in .gl/*.deb; do dpkg -x "$deb" /; done
    ldconfig
fi
if [ "$size" = full ] && [ -d .whl ]; then  # packages the GPU image lacks, as wheels (nothing can be fetched there)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site .whl/*.whl \
        || { note "installing .whl failed"; exit 1; }
    export PYTHONPATH=/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
"$python" -c "import torch, lerobot, metaworld; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tee -a "$log"

work_dir=$(mktemp -d)
trap 'rm -rf "$work_dir"' EXIT
if [ "$size" = tiny ]; then
    common=(--size tiny --batch-sizes 1,2 --repeats 1 --rollouts 2 --rollout-repeats 2)
    turns=1 compiled_batch=2
else
    # 2 rollouts of the recipe's actor (4 envs x 8 decisions) trained on 8 times over: the recipe's 512 decisions
    common=(--batch-sizes 1,16,64 --repeats 3 --rollouts 2 --rollout-repeats 8)
    turns=2 compiled_batch=16  # each compile costs tens of seconds per batch size: one size
fi

part() {  # part NAME SECONDS ARGS...: one bench run, cut at SECONDS, its figures in NAME.txt
    local name=$1 seconds=$2
    shift 2
    note "$name: start (at most ${seconds}s)"
    timeout --signal=INT --kill-after=20 "$seconds" "$python" bench/smolvla_gpu.py --work-dir "$work_dir" "$@" \
        >"$report_dir/$name.txt" 2>>"$log"
    local status=$?
    note "$name: exit $status after $SECONDS s in all"
    return $status
}

wanted() { [[ " $parts " == *" $1 "* ]]; }

status=0
if wanted smolvla; then
    part smolvla $((budget_seconds - 60)) "${common[@]}" --fused-attention --skip prepare --group-of-one "$turns" \
        --update-variants "learner.speed.fused_attention=true;actors.speed.send_image_embeddings=true" || status=$?
fi
left=$((budget_seconds - SECONDS))
if wanted compiled && [ "$left" -gt 60 ]; then
    part compiled "$left" "${common[@]}" --batch-sizes "${compiled_batch}" --compile-steps --compile-vision --fused-attention \
        --skip prepare,publish_load_sample_v1 --update-variants "" || status=$?
elif wanted compiled; then
    note "compiled: not run, ${left}s left"
fi
exit $status
