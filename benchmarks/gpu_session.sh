#!/usr/bin/env bash
# The GPU measurements, in parts, for a GPU machine lent in sessions of 15 minutes of device time (its start
# counted), at most 10 minutes a command: about 12 minutes of commands a session, in one call of up to ~540 s
# and, on the still-warm machine, a second of up to ~150 s.
#
#   DEADLINE=540 bash benchmarks/gpu_session.sh PART [PART ...]   # the parts in the order given, in one call
#   DRY_RUN=1 bash benchmarks/gpu_session.sh PART ...             # print the commands and estimates (no GPU)
#
# The parts that finish the benchmark protocol (benchmarks/README.md), in priority order, with the seconds each
# takes as estimated from the recorded H200 runs (benchmarks/results/2026-11-2[678]_H200_*; "~" where no run of
# that kind was recorded):
#   flagship    230  8B, 16 x 4096, clipping, 1 + 5 timed steps, 1 traced (kernel categories); with clipping the
#                    8B's fp32 state needs 121.7 GiB of host RAM of 118.1: the plan keeps 9 blocks' state on the GPU
#   compiled    510  Plan.compiled_layers: one 8B decoder layer eager against torch.compile (the profile's probe,
#                    ~120: the speedup, the attention operators each ran, the compile's seconds), then the
#                    flagship's run with the layers eager and compiled, 1 + 5 timed steps each, in two processes
#                    (~2 x 150, the compile ~90 in the compiled run's warm-up)
#   peers1b     490  the 1B peers at their best: megatrain, PyTorch, ZeRO-Offload, ZeRO-3 at micro-batch 4/8/16,
#                    FSDP2 last (its 7 steps ~160 s); the DeepSpeed build 47 s of it; cut by its time budget
#   peers3b     880  the same at 3B (~500 without FSDP2's ~380: the budget cuts it and says so)
#   calibrate   120  megatrain-plan profile (disk too) and calibrate (bf16, 4-layer models): KEEP/hardware.json
#   validation  200  plan_validation's GPU configs against the calibrated profile (this call's, or HARDWARE=path)
#   moe         100  a 6.9B Qwen3-MoE shape (10 of Qwen3-30B-A3B's 48 layers), grouped experts, 6 steps
#   largest     525  Qwen2.5-14B's shape, bf16 AdamW state, m and v spilled to disk, 6 steps, memory against plan
#   seq8192     155  1B (against PyTorch, losses) and 3B (megatrain and PyTorch) at 8192 tokens
#   racecheck   300  compute-sanitizer racecheck on two tiny steps (over 120 s under it)
# (planner = calibrate validation.) Each call also spends ~12 s on its set-up (the venv, the project).
# About 3,560 s in all: five sessions, in this order (results-*.tgz of each unpacked into
# benchmarks/results/ before the next; session 3's calibrated session/hardware.json carried into session 4 as
# HARDWARE=path, which also spares largest its own profile):
#   1: DEADLINE=540 ... flagship peers1b;              DEADLINE=150 ... moe
#   2: DEADLINE=540 ... peers3b;                       DEADLINE=150 ... seq8192 (its 3B pair may be cut)
#   3: DEADLINE=540 ... calibrate validation racecheck (racecheck gets the ~200 s left)
#   4: DEADLINE=540 HARDWARE=... ... largest
#   5: DEADLINE=540 ... compiled
#
# Earlier parts, kept to reproduce the recorded results they made (2026-11-26..28; no clipping, 2-3 timed steps):
#   checks (CUDA tests, 1B against PyTorch, 8B), anatomy (1B variants, sanitizers), long (8B at 32k..512k),
#   large (3B anatomy, profile, fp32 calibrate, validation), first, offload, and `peers ARGS` (peers.py --sweep
#   --resume with ARGS; it takes the rest of the command line, so it comes last).
#
# DEADLINE=S (seconds, default none) ends the call in time to return its files: each step's limit is cut to
# what is left, and a step that would get under 20 s is skipped (said in the log).
#
# What comes back: $OUT (default ./gpu_out) holds two files, PARTS.log (every step's output) and
# results-PARTS.tgz (PARTS: the parts joined by "-"), rewritten after every step: the new files of
# benchmarks/results/ and session/ (KEEP, default /tmp/gpu-session-keep): the hardware profile, the plans the
# planner made, the training runs' folders (metrics.jsonl, run.json; never a checkpoint or a spill file), the
# train_watch records (the spill disk's peak) and venv-packages.txt. The training runs go to KEEP, spill files to
# SPILL (default /tmp/megatrain-spill), removed after the part: nothing large is written under $OUT.
# megatrain-train ends every run with a checkpoint (no option skips it) that the 64 GiB disk cannot hold for the
# moe (76.6 GiB) and largest (110.0 GiB beside 55.0 GiB of spill files) runs: benchmarks/train_watch.py stops
# them with Ctrl-C twice once their 6th metrics row is written.
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
set -uo pipefail
usage="usage: gpu_session.sh PART [PART ...]: flagship compiled peers1b peers3b calibrate validation moe largest
seq8192 racecheck (planner = calibrate validation); earlier: checks anatomy long large first offload, peers [ARGS] last"
declare -A estimate=([flagship]=230 [compiled]=510 [peers1b]=490 [peers3b]=880 [calibrate]=120 [validation]=200 [moe]=100
  [largest]=525 [seq8192]=155 [racecheck]=300 [checks]=340 [anatomy]=585 [long]=600 [large]=800 [first]=523
  [offload]=481 [peers]=500)
parts=()
peer_args=()
while [ $# -gt 0 ]; do
  case $1 in
    planner) parts+=(calibrate validation) ;;
    peers) parts+=(peers); shift; peer_args=("$@"); break ;;
    flagship|compiled|peers1b|peers3b|calibrate|validation|moe|largest|seq8192|racecheck|checks|anatomy|long|large|first|offload)
      parts+=("$1") ;;
    *) echo "gpu_session.sh: unknown part ${1@Q}; $usage" >&2; exit 2 ;;
  esac
  shift
done
[ ${#parts[@]} -gt 0 ] || { echo "$usage" >&2; exit 2; }
tag=$(IFS=-; echo "${parts[*]}")
out=${OUT:-$PWD/gpu_out}
keep=${KEEP:-/tmp/gpu-session-keep}
spill=${SPILL:-/tmp/megatrain-spill}
dry=${DRY_RUN:-}
log="$out/$tag.log"
if [ -n "$dry" ]; then log=/dev/null; else mkdir -p "$out"; fi
export PYTHONUNBUFFERED=1
stamp=$(mktemp)
started=$SECONDS
[ -z "$dry" ] && { rm -rf "$keep"; mkdir -p "$keep"; }

say() { echo "== $* ($((SECONDS - started)) s)" | tee -a "$log"; }
# The results written so far in this call and the small files of KEEP, in one file (a file over 8 MiB left out)
pack() {
  { find benchmarks/results -type f -newer "$stamp" -print0; find "$keep" -type f -size -8M -print0; } |
    tar czf "$out/results-$tag.tgz" --null -T - --transform "s|^${keep#/}|session|" 2>>"$log"
}
# run SECONDS CMD...: one step under its own time limit, its output in the log; a failure does not stop the call
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
    >"$keep/venv-packages.txt" 2>>"$log"
fi
export PATH="$venv/bin:$PATH"  # megatrain-plan, megatrain-train and the venv's python3 first

# A peers sweep's own budget: its step's limit less 20 s, or what DEADLINE leaves less a minute, so that a case
# cut short is recorded rather than interrupted
peers_budget() {
  local budget=$(($1 - 20))
  if [ -n "${DEADLINE:-}" ]; then
    local left=$((DEADLINE - (SECONDS - started) - 60))
    [ "$left" -lt "$budget" ] && budget=$left
  fi
  echo "$budget"
}
# The hardware profile a part plans with: HARDWARE=path where given, else this call's calibrate's
hardware() { if [ -n "${HARDWARE:-}" ]; then echo "$HARDWARE"; else echo "$keep/hardware.json"; fi; }
# The planner's plan for a megatrain-train run, as JSON into KEEP (what the run is measured against)
plan_json() { local name=$1; shift; run 60 sh -c 'out=$1; shift; megatrain-plan plan "$@" --json >"$out"' sh \
  "$keep/${name}_plan.json" "$@"; }

total=0
for part in "${parts[@]}"; do
  total=$((total + ${estimate[$part]}))
  say "part $part (estimate ${estimate[$part]} s)"
  case $part in
  flagship)
    # The headline: Llama-3.1-8B's shape, 16 x 4096 tokens, clipping (max_norm 1.0), the planner's plan, 1 warm-up
    # and 5 timed steps (written before the trace), then 1 traced step: the kernels by category
    run 330 python3 benchmarks/step_anatomy.py --model 8b --seq 4096 --batch 16 --planner-only \
      --warmup 1 --steps 5 --traced 1
    ;;
  compiled)
    # Plan.compiled_layers against eager: first one Llama-3.1-8B decoder layer at 4 x 4096 tokens, the step's forward,
    # recompute and backward, eager and compiled alternated (what megatrain-plan profile --compiled-layers stores);
    # then the flagship's shape and plan with the layers eager, then compiled (its warm-up step compiles), each in a
    # process of its own (the 8B's host state fills the RAM: one engine at a time)
    run 240 sh -c 'python3 -m megatrain.tools.compiled_layer_probe --shape 8b --device cuda --dtype bfloat16 >"$1"' \
      sh "$keep/compiled_layer_probe.json"
    for variant in uncompiled compiled; do
      run 300 python3 benchmarks/step_anatomy.py --model 8b --seq 4096 --batch 16 --planner-only \
        --variant "$variant" --warmup 1 --steps 5 --traced 0
    done
    ;;
  peers1b|peers3b)
    # megatrain, in-VRAM PyTorch, ZeRO-Offload, ZeRO-3 at micro-batches 4, 8, 16, then FSDP2 (the slowest) in
    # the budget left; --resume keeps today's report's other runs
    run 500 python3 benchmarks/peers.py --model "${part#peers}" --seq 2048 --batch 16 --micro-batch 4 --resume \
      --time-budget "$(peers_budget 500)" --systems megatrain,pytorch,zero_offload,deepspeed,fsdp2
    ;;
  calibrate)
    # The GPU's own figures (the spill disk's too) and the constants fitted from the calibration's 4-layer models
    # (widths 256..1024) in bf16: the profile the validation checks out of sample
    [ -z "$dry" ] && mkdir -p "$spill-probe"
    run 90 megatrain-plan profile --spill-dir "$spill-probe" --out "$keep/hardware.json"
    run 200 megatrain-plan calibrate --dtype bf16 --rounds 1 --out "$keep/hardware.json"
    rm -rf "$spill-probe"
    ;;
  validation)
    # The planner against the runtime on shapes apart from the calibration's: 1B at 8192, 3B, the 8B (its
    # 24-layer cut where the whole one gets no plan), a Qwen3-MoE shape; step, peak host RSS, peak GPU memory
    [ -n "$dry" ] || [ -f "$(hardware)" ] || say "no calibrated profile at $(hardware) (HARDWARE=path, or calibrate first)"
    run 300 env MEGATRAIN_HARDWARE="$(hardware)" python3 benchmarks/plan_validation.py --rounds 1 --steps 3 \
      --only 1B-8192,3B,8B,8B-24L,moe-gpu
    ;;
  moe)
    # A 6.9B mixture of experts: Qwen3-30B-A3B's shape with 10 of its 48 layers (128 experts, 8 active; 12 layers'
    # fp32 state needs 122.7 GiB of host RAM), grouped expert matmuls; tokens/s, model TFLOP/s with 6 x active
    # N_matmul, the expert load: metrics.jsonl
    [ -z "$dry" ] && mkdir -p "$keep/qwen3-moe-10l"
    run 30 python3 -c "import json, sys; from megatrain.planner.shapes.model_shapes import PRESETS
cfg = dict(PRESETS['shape:Qwen3-30B-A3B'].config, num_hidden_layers=10)
json.dump(cfg, open(sys.argv[1], 'w'), indent=1)" "$keep/qwen3-moe-10l/config.json"
    plan_json moe --model "$keep/qwen3-moe-10l/config.json" --seq-len 4096 --batch 8
    run 300 python3 benchmarks/train_watch.py --stop-after 6 --run-dir "$keep/moe" --record "$keep/moe_watch.json" \
      -- megatrain-train --model "$keep/qwen3-moe-10l/config.json" --seq-len 4096 --batch 8 --steps 6 \
      --max-grad-norm 1.0 --spill none --progress plain --log-every 1 --out "$keep/moe"
    ;;
  largest)
    # Qwen2.5-14B's shape on this machine (128 GiB RAM, 64 GiB disk): fp32 masters and gradients in RAM, bf16 m and
    # v (55.0 GiB) in spill files, 6 steps; peak host, GPU (metrics.jsonl) and disk (largest_watch.json) against
    # largest_plan.json. --spill optimizer (auto finds the same plan)
    [ -z "$dry" ] && mkdir -p "$spill-probe"
    [ -n "${HARDWARE:-}" ] || run 90 megatrain-plan profile --spill-dir "$spill-probe" --out "$keep/hardware.json"
    rm -rf "$spill-probe"
    big=(--model shape:Qwen2.5-14B --seq-len 4096 --batch 8 --optimizer-state bf16 --spill optimizer
         --spill-dir "$spill")
    plan_json largest "${big[@]}" --hardware "$(hardware)"
    run 480 env MEGATRAIN_HARDWARE="$(hardware)" python3 benchmarks/train_watch.py --stop-after 6 \
      --run-dir "$keep/largest" --watch "$spill" --record "$keep/largest_watch.json" \
      -- megatrain-train "${big[@]}" --steps 6 --max-grad-norm 1.0 --progress plain --log-every 1 --out "$keep/largest"
    [ -z "$dry" ] && rm -rf "$spill"
    # what the planner says this machine trains (fp32 state)
    run 60 sh -c 'megatrain-plan --seq-len 4096 --spill-dir "$1" --hardware "$2" >"$3"' sh "$keep" "$(hardware)" \
      "$keep/largest_overview.txt"
    ;;
  seq8192)
    # 1B and 3B at 8192 tokens against in-VRAM PyTorch (the 1B ran at 0.63x PyTorch there); 1 + 5 timed steps
    run 200 python3 benchmarks/throughput.py --model 1b --seq 8192 --batch 4 --micro-batch 1 --steps 6
    run 200 python3 benchmarks/peers.py --model 3b --seq 8192 --batch 4 --micro-batch 1 --resume \
      --systems megatrain,pytorch --time-budget "$(peers_budget 200)"
    ;;
  racecheck)
    # races between the streams, two steps of a tiny model
    run 300 compute-sanitizer --tool racecheck --target-processes all \
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
    run 500 python3 benchmarks/peers.py --sweep --resume --time-budget "$(peers_budget 500)" "${peer_args[@]}"
    ;;
  offload)
    # with .whl/ carried, kvikio is installed: the spilled-load test runs its kvikio case too
    run 100 python3 -m pytest -q -rA --tb=short -m gpu -p no:cacheprovider tests
    run 500 python3 benchmarks/peers.py --sweep --resume --time-budget "$(peers_budget 500)" --sizes 3b \
      --grow-layers 0 --systems megatrain,deepspeed,pytorch,fsdp2
    ;;
  large)
    run 240 python3 benchmarks/step_anatomy.py --model 3b --seq 2048,8192 --batch 8 --micro-batch 2 --steps 2 --traced 1
    # the GPU's own figures (copies, matmul and causal-attention rates) and fitted constants before the table
    run 120 megatrain-plan profile --out "$keep/hardware.json"
    run 240 megatrain-plan calibrate --out "$keep/hardware.json"  # fp32, as the table
    run 200 env MEGATRAIN_HARDWARE="$keep/hardware.json" python3 benchmarks/plan_validation.py --quick
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
    run 120 megatrain-plan profile --out "$keep/hardware.json"
    ;;
  esac
done

say "estimate for this call: $total s of commands${DEADLINE:+ (DEADLINE $DEADLINE s)}"
pack
[ -n "$dry" ] && exit 0
say "done; results-$tag.tgz holds: $(tar tzf "$out/results-$tag.tgz" | tr '\n' ' ')"
