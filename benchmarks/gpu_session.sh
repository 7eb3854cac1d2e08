#!/usr/bin/env bash
# One GPU session in one go (prepared on the CPU; GPU time is short): every log is teed into
# benchmarks/results/ (and into $OUT when the device tool sets it, so the logs come back).
#
#     bash benchmarks/gpu_session.sh            # from the repository root, on the GPU machine
#
# On the device machine (see /work/.library/device/README.md): the checkout travels as the
# working tree; wheels the image lacks travel in .whl/ (ignored by git: `echo /.whl/ >>
# .git/info/exclude`, then `python3 -m pip download --no-deps --only-binary=:all:
# --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 -d .whl
# 'cattrs>=24.1' 'attrs>=25.4'`; both are pure-Python wheels) and are named in the call's
# `carry`. Budget: about 6 minutes of GPU time (run it with timeout_s 600).
#
# What runs, in order (each under its own `timeout`, a failure does not stop the others):
#   1. the environment: nvidia-smi, torch / transformers / attrs / cattrs versions;
#   2. python benchmarks/gpu_check.py --steps 5: every check (flex, bf16, chunked, nccl, fsdp,
#      step, eval, packing, run);
#   3. python benchmarks/gpu_check.py --only step --profile: the step's phases and the top
#      CUDA kernels, with the Chrome trace;
#   4. the trainer through torchrun on one GPU with training.fsdp (the CLI's FSDP path; the
#      DDP path is gpu_check's `run` check).
# The other benchmarks under benchmarks/ are CPU measurements (their devices are fixed to the
# CPU: bench_memory, bench_step_overhead, bench_chunked_loss, ...); gpu_check's `step` and
# `--profile` are their CUDA counterparts, so none of them runs here.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
STAMP=$(date -u +%Y-%m-%d)
RESULTS=$ROOT/benchmarks/results
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "gpu_session: the carried wheels did not install"; exit 1; }
    export PYTHONPATH=/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi

# step NAME SECONDS COMMAND...: runs COMMAND, its output teed into results/NAME-DATE.log
status=0
step() {
    local name=$1 seconds=$2
    shift 2
    local log=$RESULTS/$name-$STAMP.log
    echo "== gpu_session: $name: $*" | tee "$log"
    set -o pipefail
    timeout "$seconds" "$@" 2>&1 | tee -a "$log"
    local rc=$?
    set +o pipefail
    echo "== gpu_session: $name exit code $rc" | tee -a "$log"
    [ "$rc" -eq 0 ] || status=1
    if [ -n "${OUT:-}" ]; then cp "$log" "$OUT/"; fi
}

step gpu_session_env 60 bash -c 'nvidia-smi; python3 -c "
import attrs, cattrs, torch, transformers
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name(0))
print(\"transformers\", transformers.__version__, \"attrs\", attrs.__version__, \"cattrs\", cattrs.__version__)
"'
step gpu_check 300 python3 benchmarks/gpu_check.py --steps 5
step gpu_check_profile 180 python3 benchmarks/gpu_check.py --only step --steps 3 --profile \
    --profile-trace "$RESULTS/gpu_check_profile-$STAMP.trace.json"
if [ -n "${OUT:-}" ] && [ -f "$RESULTS/gpu_check_profile-$STAMP.trace.json" ]; then
    gzip -c "$RESULTS/gpu_check_profile-$STAMP.trace.json" >"$OUT/gpu_check_profile-$STAMP.trace.json.gz"
fi
FSDP_OUT=$(mktemp -d)
step torchrun_fsdp 180 python3 -m dflash_recipes run recipes/tiny/tiny_released.yaml \
    "training.output_dir=$FSDP_OUT/run" training.device=cuda training.fsdp=true \
    training.eval_steps=0 training.max_steps=20 --nproc-per-node 1 --no-progress

echo "== gpu_session: done (exit $status); logs in $RESULTS"
exit $status
