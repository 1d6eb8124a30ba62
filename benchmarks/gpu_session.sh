#!/usr/bin/env bash
# The GPU measurements, in parts of under ten minutes each, for a GPU machine reached in short sessions.
#
# The parts that finish the benchmark protocol (benchmarks/README.md), in priority order, one a session of
# about 15 minutes of device time (what does not fit is the next session's):
#   DEADLINE=540 bash benchmarks/gpu_session.sh flagship  # 8B, 16 x 4096, clipping, 1 + 5 timed steps; then the
#                                                         # 1B peers at their best in the time left (--resume)
#   DEADLINE=540 bash benchmarks/gpu_session.sh peers --model-sizes  # see below: the peers at their best
#   DEADLINE=540 bash benchmarks/gpu_session.sh planner   # profile + calibrate (bf16) on this GPU, then the
#                                                         # planner checked out of sample: plan_validation,
#                                                         # 1B at 8192 and 3B at 2048 against their predictions
#   DEADLINE=540 bash benchmarks/gpu_session.sh largest   # the planner's largest dense model (Qwen2.5-14B's
#                                                         # shape, spill to disk), 6 steps, memory against the plan
#   DEADLINE=540 bash benchmarks/gpu_session.sh moe       # a ~7B Qwen3-MoE shape (Qwen3-30B-A3B's, 12 layers),
#                                                         # grouped experts, 6 steps; tokens/s, 6 x active N_matmul
#   DEADLINE=540 bash benchmarks/gpu_session.sh seq8192   # 1B and 3B at 8192 tokens against PyTorch; racecheck
# `peers` resumes today's report: `peers --sizes 1b --seqs 2048 --grow-layers 0`, then `--sizes 3b`.
# DRY_RUN=1 prints every command of a part instead of running it (no GPU needed): a check of the script.
#
# Earlier parts, kept to reproduce the recorded results they made (2026-11-26..28; no clipping, 2-3 timed steps):
#   bash benchmarks/gpu_session.sh checks   # CUDA tests, 1B losses and speed against PyTorch, 8B flagship (~7 min)
#   bash benchmarks/gpu_session.sh anatomy  # 1B step anatomy (planner, host checkpoints, eager); compute-sanitizer
#   bash benchmarks/gpu_session.sh long     # 8B at 32k, 128k and 512k tokens a sequence
#   bash benchmarks/gpu_session.sh large    # 3B step anatomy at 2048/8192, profile, calibrate, planner validation
#   bash benchmarks/gpu_session.sh first    # one command for a short lease: checks, 1B, 8B flagship, anatomy,
#                                           # stream sanitizer, the GPU's profile
#   bash benchmarks/gpu_session.sh offload  # the CUDA tests with kvikio from .whl/, then the 3B peers against
#                                           # DeepSpeed ZeRO-3 offload (the rest of the DEADLINE, or 480 s)
#
# DEADLINE=S (seconds, default none) ends a part in time to return its files: each step's limit is cut to
# what is left, and a step that would get under 20 s is skipped. results-PART.tgz is rewritten after every step.
#
# Packages: the project and the wheels named in benchmarks/gpu_wheels.txt (DeepSpeed and what it needs, kvikio)
# go into a venv made with --system-site-packages ($VENV, default /tmp/megatrain-venv): the image's packages stay
# visible and a named wheel is installed only where the image lacks its distribution, so none of the image's
# packages is shadowed. Where there is network access, put those wheels into .whl/ and carry .whl/ with the
# checkout:
#   pip wheel --no-deps -w .whl deepspeed==0.19.8     # DeepSpeed ships an sdist: a pure-Python wheel, ops JIT-built
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl \
#     hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
#     typing-extensions==4.16.0 kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 nvidia-cufile==1.20.0.107 \
#     rapids-logger==0.3.0 cuda-pathfinder==1.9.1
# The venv's own packages are listed in $OUT/venv-packages.txt. Everything is written under $OUT (default
# ./gpu_out): one log per part and results-PART.tgz, the new files of benchmarks/results/ (and the training
# runs' folders). Unpack it into benchmarks/results/ of the checkout the next part starts from: `peers --resume`
# goes on from the sweep results it finds there.
set -uo pipefail
part=${1:?usage: gpu_session.sh flagship|peers|planner|largest|moe|seq8192|checks|anatomy|long|large|first|offload}
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

dry=${DRY_RUN:-}
if [ -n "$dry" ]; then
  run() { shift; echo "+ $*"; }
  pack() { :; }
fi

say "machine"
[ -z "$dry" ] && { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g; df -h /tmp .
  python3 -c 'import torch, sys; print(sys.version, torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'
} >>"$log" 2>&1

# The project and the named wheels in a venv over the image's packages (see the top of this file).
venv=${VENV:-/tmp/megatrain-venv}
py="$venv/bin/python"
# pip of the venv; where the image's python3 has no ensurepip, the image's pip installs into it (pip >= 22.3)
venv_pip() { if "$py" -m pip --version >/dev/null 2>&1; then "$py" -m pip "$@"; else python3 -m pip --python "$py" "$@"; fi; }
# install_wheels: each wheel of benchmarks/gpu_wheels.txt that .whl/ holds, unless the image has its distribution
install_wheels() {
  local wheel dist
  grep -v '^#' benchmarks/gpu_wheels.txt | while read -r wheel; do
    [ -z "$wheel" ] && continue
    dist=${wheel%%-*}
    if python3 -c 'import importlib.metadata as m, sys; print(sys.argv[1], m.version(sys.argv[1]), "in the image: kept")' \
        "$dist" 2>/dev/null; then continue; fi
    if [ -f ".whl/$wheel" ]; then venv_pip install -q --no-index --no-deps --no-compile ".whl/$wheel" && echo "$wheel"
    else echo "$wheel: not in .whl/ (what needs it is recorded as not run)"; fi
  done
}
if [ -n "$dry" ]; then
  echo "+ python3 -m venv --system-site-packages $venv; $py -m pip install --no-deps --no-build-isolation -e ."
  echo "+ from .whl/, where the image lacks the distribution: $(grep -v '^#' benchmarks/gpu_wheels.txt | tr '\n' ' ')"
else
  { python3 -m venv --system-site-packages "$venv" || python3 -m venv --system-site-packages --without-pip "$venv"
  } >>"$log" 2>&1
  say "venv $venv: the project, then the named wheels the image lacks"
  venv_pip install -q --no-deps --no-build-isolation -e . >>"$log" 2>&1
  [ -d .whl ] && install_wheels >>"$log" 2>&1
  venv_pip list --path "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    >"$out/venv-packages.txt" 2>>"$log"
fi
export PATH="$venv/bin:$PATH"  # megatrain-plan, megatrain-train and the venv's python3 first

# The peers sweep's own budget: 480 s, or what DEADLINE leaves less a minute, so a case cut short is recorded
peers_budget() { if [ -n "${DEADLINE:-}" ]; then echo $((DEADLINE - (SECONDS - started) - 60)); else echo 480; fi; }

case $part in
  flagship)
    # The headline: Llama-3.1-8B's shape, 16 x 4096 tokens, clipping (max_norm 1.0), the planner's plan, 1 warm-up
    # and 5 timed steps; model TFLOP/s = 6 x N_matmul x tokens / median step. No profiler: its parse outlasts a step.
    run 330 python3 benchmarks/step_anatomy.py --model 8b --seq 4096 --batch 16 --planner-only \
      --warmup 1 --steps 5 --traced 0
    # then the 1B peers at their best in what is left (resumed by the `peers` part)
    run 500 python3 benchmarks/peers.py --model 1b --seq 2048 --batch 16 --micro-batch 4 --resume \
      --time-budget "$(peers_budget)" --systems megatrain,pytorch,zero_offload,deepspeed,fsdp2
    ;;
  planner)
    # The GPU's own figures, the constants fitted from its calibration runs (4-layer models, widths 256..1024),
    # then the planner checked on shapes apart from them: plan_validation's configs (the 1B among them), and the
    # 1B at 8192 and 3B at 2048 step anatomy rows (each holds the planner's prediction for the plan it ran)
    export MEGATRAIN_HARDWARE="$out/hardware.json"
    run 120 megatrain-plan profile --out "$MEGATRAIN_HARDWARE"
    run 200 megatrain-plan calibrate --dtype bf16 --rounds 1 --out "$MEGATRAIN_HARDWARE"
    run 150 python3 benchmarks/plan_validation.py --rounds 1 --only 300M,wide-shallow,deep-narrow,1B-fp32
    run 200 python3 benchmarks/step_anatomy.py --model 1b,3b --seq 8192 --batch 4 --planner-only --warmup 1 \
      --steps 5 --traced 0
    ;;
  largest)
    # What the planner says this machine (H200, 128 GiB RAM, 64 GiB disk) trains, then its largest dense real shape:
    # Qwen2.5-14B's, fp32 masters, bf16 AdamW state where that makes it fit, the rest spilled to the disk; 6 steps
    run 60 sh -c "megatrain-plan --seq-len 4096 --spill-dir /tmp/megatrain-spill >'$out/largest_overview.txt'"
    run 80 sh -c "megatrain-plan plan --model shape:Qwen2.5-14B --seq-len 4096 --batch 8 --optimizer-state bf16 \
      --spill auto --spill-dir /tmp/megatrain-spill >'$out/largest_plan.txt'"
    # metrics.jsonl keeps every step's line as it ends; the run's last act is its final checkpoint (megatrain-train
    # always writes one), about 8 bytes a parameter: where the disk cannot hold it beside the spill files, that
    # save fails after the steps were recorded
    run 420 megatrain-train --model shape:Qwen2.5-14B --seq-len 4096 --batch 8 --steps 6 --max-grad-norm 1.0 \
      --optimizer-state bf16 --spill auto --spill-dir /tmp/megatrain-spill --progress plain --log-every 1 \
      --out "$out/largest_qwen2.5-14b"
    ;;
  moe)
    # A ~7B mixture of experts: Qwen3-30B-A3B's shape with 12 of its 48 layers (128 experts, 8 active), grouped
    # expert matmuls; tokens/s, model TFLOP/s with 6 x active N_matmul, the expert load in metrics.jsonl
    mkdir -p "$out/qwen3-moe-12l"
    run 30 python3 -c "import json, sys; from megatrain.planner.shapes.model_shapes import PRESETS
cfg = dict(PRESETS['shape:Qwen3-30B-A3B'].config, num_hidden_layers=12)
json.dump(cfg, open(sys.argv[1], 'w'), indent=1)" "$out/qwen3-moe-12l/config.json"
    run 400 megatrain-train --model "$out/qwen3-moe-12l/config.json" --seq-len 4096 --batch 8 --steps 6 \
      --max-grad-norm 1.0 --progress plain --log-every 1 --out "$out/moe_qwen3-12l"
    ;;
  seq8192)
    # 1B and 3B at 8192 tokens against in-VRAM PyTorch (the 1B ran at 0.63x PyTorch there); 1 + 5 timed steps
    run 200 python3 benchmarks/throughput.py --model 1b --seq 8192 --batch 4 --micro-batch 1 --steps 6
    run 200 python3 benchmarks/peers.py --model 3b --seq 8192 --batch 4 --micro-batch 1 --resume \
      --systems megatrain,pytorch --time-budget "$(peers_budget)"
    # races between the streams, two steps of a tiny model (racecheck is slow: it gets what is left)
    run 240 compute-sanitizer --tool racecheck --target-processes all \
      python3 benchmarks/throughput.py --model tiny --seq 128 --batch 4 --micro-batch 2 --steps 2 --out /tmp/scratch
    ;;
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
  *) echo "unknown part $part: flagship, peers, planner, largest, moe, seq8192 (or the earlier checks, anatomy, long,"\
       "large, first, offload)" >&2; exit 2 ;;
esac

pack
[ -n "$dry" ] && exit 0
say "done; results-$part.tgz holds: $(tar tzf "$out/results-$part.tgz" | tr '\n' ' ')"
