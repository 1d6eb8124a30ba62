#!/usr/bin/env bash
# The GPU measurements, in parts of under ten minutes each, for a GPU machine reached in short sessions.
#
#   bash benchmarks/gpu_session.sh checks   # CUDA tests, 1B losses and speed against PyTorch, 8B flagship (~7 min)
#   bash benchmarks/gpu_session.sh anatomy  # 1B step anatomy (planner, host checkpoints, eager); compute-sanitizer
#   bash benchmarks/gpu_session.sh long     # 8B at 32k, 128k and 512k tokens a sequence
#   bash benchmarks/gpu_session.sh peers    # peers sweep, 480 s or what DEADLINE leaves (DeepSpeed wheels in .whl/);
#                                           # more arguments go to peers.py (--sizes 3b --grow-layers 0)
#   bash benchmarks/gpu_session.sh large    # 3B step anatomy at 2048/8192, profile, calibrate, planner validation
#   bash benchmarks/gpu_session.sh first    # one command for a short lease: checks, 1B, 8B flagship, anatomy,
#                                           # stream sanitizer, the GPU's profile
#   bash benchmarks/gpu_session.sh offload  # the CUDA tests with kvikio from .whl/, then the 3B peers against
#                                           # DeepSpeed ZeRO-3 offload (the rest of the DEADLINE, or 480 s)
#
# DEADLINE=S (seconds, default none) ends a part in time to return its files: each step's limit is cut to
# what is left, and a step that would get under 20 s is skipped. results-PART.tgz is rewritten after every step.
#
# Before `peers`, where there is network access, put DeepSpeed's wheel and the packages it needs that a CUDA
# image may lack into .whl/, for Python 3.12 on x86-64, and copy .whl/ along with the checkout:
#   pip wheel --no-deps -w .whl deepspeed          # DeepSpeed ships an sdist: a pure-Python wheel, ops JIT-built
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl \
#     hjson pydantic pydantic-core annotated-types typing-inspection
# Everything is written under $OUT (default ./gpu_out): one log per part and results-PART.tgz, the new
# files of benchmarks/results/. Unpack it into benchmarks/results/ of the checkout the next part
# starts from: `peers --resume` goes on from the sweep results it finds there.
set -uo pipefail
part=${1:?usage: gpu_session.sh checks|anatomy|long|peers|large|first|offload}
out=${OUT:-$PWD/gpu_out}
mkdir -p "$out"
log="$out/$part.log"
export PYTHONUNBUFFERED=1
stamp=$(mktemp)
started=$SECONDS

say() { echo "== $* ($((SECONDS - started)) s)" | tee -a "$log"; }
# The results written so far in this part (and any PNG), in one file.
pack() { find benchmarks/results -type f -newer "$stamp" -print0 | tar czf "$out/results-$part.tgz" --null -T - 2>>"$log"; }
# run SECONDS CMD...: one step under its own time limit, its output in the log; a failure does not stop the part
run() {
  local limit=$1; shift
  if [ -n "${DEADLINE:-}" ]; then
    local left=$((DEADLINE - (SECONDS - started) - 25))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 20 ]; then say "skipped, too little time left: $*"; return; fi
  fi
  say "$* (limit $limit s)"
  timeout --signal=INT --kill-after=15 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  say "exit $rc"
  pack
}

say "machine"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g; df -h /tmp .
  python3 -c 'import torch, sys; print(sys.version, torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'
} >>"$log" 2>&1
# The project itself, offline: its dependencies are in the image (tensorstore, safetensors, psutil, transformers).
run 120 python3 -m pip install -q --no-deps --no-build-isolation -e .
if [ -d .whl ]; then
  run 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# The peers sweep's own budget: 480 s, or what DEADLINE leaves less a minute, so a case cut short is recorded
peers_budget() { if [ -n "${DEADLINE:-}" ]; then echo $((DEADLINE - (SECONDS - started) - 60)); else echo 480; fi; }

case $part in
  checks)
    run 80 python3 -m pytest -q -m gpu -p no:cacheprovider tests
    # 20 bf16 steps against in-VRAM PyTorch from the same weights: the losses step by step, and the speed
    run 120 python3 benchmarks/throughput.py --model 1b --seq 2048 --batch 8 --micro-batch 4 --steps 20
    # the flagship: Llama-3.1-8B's shape at 4096 tokens, the planner's plan, fp32 masters and AdamW state in RAM
    run 240 python3 benchmarks/step_anatomy.py --model 8b --seq 4096 --batch 16 --no-clip --planner-only \
      --warmup 1 --steps 2 --traced 1
    ;;
  anatomy)
    run 150 python3 benchmarks/step_anatomy.py --model 1b --seq 2048 --batch 16 --micro-batch 4 \
      --variant planner,host-ckpt,eager --steps 3 --traced 2
    # races and missing synchronization between the streams, on two steps of a tiny model
    for tool in racecheck synccheck; do
      run 240 compute-sanitizer --tool $tool --target-processes all \
        python3 benchmarks/throughput.py --model tiny --seq 128 --batch 4 --micro-batch 2 --steps 2
    done
    ;;
  long)
    # the 8B shape at 32k, 128k and (on an H200) 512k tokens a sequence; no profiler: its parse outlasts the steps
    for case in "32768 2" "131072 1" "524288 1"; do
      set -- $case
      run 200 python3 benchmarks/step_anatomy.py --model 8b --seq "$1" --batch "$2" --micro-batch 1 --no-clip \
        --planner-only --warmup 0 --steps 1 --traced 0
    done
    ;;
  peers)
    # further arguments go to peers.py: `peers --sizes 3b --grow-layers 0` runs the 3B cases alone
    # the sweep's own budget ends inside the step's limit, so a case cut short is recorded, not interrupted
    run 500 python3 benchmarks/peers.py --sweep --resume --time-budget "$(peers_budget)" "${@:2}"
    ;;
  offload)
    # with .whl/ carried, kvikio is installed: the spilled-load test runs its kvikio case too
    run 100 python3 -m pytest -q -rA --tb=short -m gpu -p no:cacheprovider tests
    run 500 python3 benchmarks/peers.py --sweep --resume --time-budget "$(peers_budget)" --sizes 3b --grow-layers 0 \
      --systems megatrain,deepspeed,pytorch,fsdp2 "${@:2}"
    ;;
  large)
    run 240 python3 benchmarks/step_anatomy.py --model 3b --seq 2048,8192 --batch 8 --micro-batch 2 --steps 2 --traced 1
    # the GPU's own figures (copies, matmul and causal-attention rates) and fitted constants before the table
    export MEGATRAIN_HARDWARE="$out/hardware.json"
    run 120 megatrain-plan profile --out "$MEGATRAIN_HARDWARE"
    run 240 megatrain-plan calibrate --out "$MEGATRAIN_HARDWARE"  # fp32, as the table
    run 200 python3 benchmarks/plan_validation.py --quick
    ;;
  first)
    # the quick checks first: a failure there fails fast and leaves the time to the steps after it
    run 100 python3 -m pytest -q -rA --tb=short -m gpu -p no:cacheprovider tests
    # 20 bf16 steps against in-VRAM PyTorch from the same weights: the losses step by step, and the speed
    run 150 python3 benchmarks/throughput.py --model 1b --seq 2048 --batch 8 --micro-batch 4 --steps 20
    # the flagship before the rest: Llama-3.1-8B's shape at 4096 tokens, the planner's plan
    run 240 python3 benchmarks/step_anatomy.py --model 8b --seq 4096 --batch 16 --no-clip --planner-only \
      --warmup 1 --steps 2 --traced 1
    # the weights rounded on the host (a shadow AdamW writes) against on the device, and the planner's choice
    run 150 python3 benchmarks/step_anatomy.py --model 1b --seq 2048 --batch 16 --micro-batch 4 \
      --variant planner,host-cast,device-cast,eager --steps 3 --traced 1
    # PyTorch's stream sanitizer: a tensor used on one stream while another writes it, without an event between
    run 120 env TORCH_CUDA_SANITIZER=1 python3 benchmarks/throughput.py --model tiny --seq 128 --batch 4 \
      --micro-batch 2 --steps 2 --out /tmp/scratch
    # the GPU's own figures for the planner (racecheck is in `anatomy`: two tiny steps outlast 120 s under it)
    run 120 megatrain-plan profile --out "$out/hardware.json"
    ;;
  *) echo "unknown part $part: checks, anatomy, long, peers, large, first or offload" >&2; exit 2 ;;
esac

pack
say "done; results-$part.tgz holds: $(tar tzf "$out/results-$part.tgz" | tr '\n' ' ')"
