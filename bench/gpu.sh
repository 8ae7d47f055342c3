#!/usr/bin/env bash
# The GPU paths in one short run, for a machine with an NVIDIA GPU and LiveLoop installed.
#
#   bench/gpu.sh OUT_DIR [MODEL]
#
# 1. bench/trainer.py on MODEL (default tiny-random): the trainer's update against bare
#    training loops, with peak GPU memory per variant  -> OUT_DIR/trainer.json
# 2. bench/tenants.py on MODEL: the tenant-scope trainer with 1, 8 and 32 tenants and a
#    server with 32 adapters in flight, with GPU memory    -> OUT_DIR/tenants.json
# 3. `liveloop demo --model tiny-random` with the engine and the trainer on the GPU: every
#    loop, the weight swap and the gate, end to end        -> OUT_DIR/demo-report.json
# 4. (only when STEPS names it) bench/learning.py with the engine and the trainer on the GPU:
#    every arm of LEARNING_ARMS for every seed of LEARNING_SEEDS, each a run of its own, all
#    side by side, then merged                              -> OUT_DIR/learning.json
#    (LEARNING_MODEL, default qwen2.5-coder-0.5b, must already be in the model cache;
#    LEARNING_ARGS replaces the budget flags; LEARNING_KEEP=1 keeps each run's data dir)
# Each step has its own time limit; a failing step is recorded and the next one runs.
# STEPS picks steps (default "trainer tenants demo"; "learning" runs only when named),
# TENANTS_ARGS adds bench/tenants.py flags (e.g. --skip-trainer), DEVICE=cpu runs the steps
# on the CPU (a dry run).
set -u
out=${1:?usage: bench/gpu.sh OUT_DIR [MODEL]}
model=${2:-tiny-random}
device=${DEVICE:-cuda}
py=${PYTHON:-python3}
mkdir -p "$out"
status() { echo "$1 rc=$2" | tee -a "$out/steps.txt"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/env.txt" 2>&1
"$py" -c "import torch; print('torch', torch.__version__)" >> "$out/env.txt" 2>&1

steps=" ${STEPS:-trainer tenants demo} "
if [[ $steps == *" trainer "* ]]; then
timeout "${TRAINER_S:-150}" "$py" bench/trainer.py --device "$device" --model "$model" \
    --samples 16 --iters 2 > "$out/trainer.json" 2> "$out/trainer.log"
status trainer $?
fi

if [[ $steps == *" tenants "* ]]; then
# shellcheck disable=SC2086  # TENANTS_ARGS is a list of flags
timeout "${TENANTS_S:-200}" "$py" -m bench.tenants --device "$device" --model "$model" \
    --tenants 1 8 32 --batches 32 --rounds 2 ${TENANTS_ARGS:-} > "$out/tenants.json" \
    2> "$out/tenants.log"
status tenants $?
fi

if [[ $steps == *" demo "* ]]; then
data=$(mktemp -d)
port=$((20000 + RANDOM % 20000))
LIVELOOP_TRAINER__DEVICE=$device LIVELOOP_SERVER__DEVICE=$device \
    timeout "${DEMO_S:-200}" "$py" -m liveloop.cli demo --model tiny-random \
    --minutes "${DEMO_MINUTES:-1.5}" --port "$port" --data-dir "$data" --quiet \
    > "$out/demo.log" 2>&1
status demo $?
cp "$data/demo/report.json" "$out/demo-report.json" 2> /dev/null
rm -rf "$data"
fi

if [[ $steps == *" learning "* ]]; then
runs="$out/learning"
mkdir -p "$runs"
read -r -a arms <<< "${LEARNING_ARMS:-rl:rl ref:combine:teacher=reference}"
read -r -a budget <<< "${LEARNING_ARGS:---turns 96 --window 24 --pace 12 --minutes-cap 4}"
keep=()
[[ -n ${LEARNING_KEEP:-} ]] && keep=(--keep-data "$runs/data")
pids=()
for seed in ${LEARNING_SEEDS:-0 1 2}; do
    for arm in "${arms[@]}"; do
        run="$runs/${arm%%:*}-$seed"
        LIVELOOP_TRAINER__DEVICE=$device LIVELOOP_SERVER__DEVICE=$device \
            timeout "${LEARNING_S:-480}" "$py" bench/learning.py \
            --models "${LEARNING_MODEL:-qwen2.5-coder-0.5b}" --seeds "$seed" "${budget[@]}" \
            --arm "$arm" "${keep[@]}" --out "$run.json" > "$run.log" 2>&1 &
        pids+=($!)
    done
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=$?; done
compare=()
(( ${#arms[@]} > 1 )) && compare=(--compare "${arms[1]%%:*},${arms[0]%%:*}")
"$py" bench/learning.py --merge "$runs"/*.json "${compare[@]}" --out "$out/learning.json" \
    > "$out/learning-merge.log" 2>&1 || failed=$?
status learning $failed
fi
