#!/usr/bin/env bash
# The 4-bit KV ring's GPU measurements in one call (issue 29; bench/RESULTS.md): the kernel against its reference
# and a sweep of its launch settings, the talker's step at 1-320 full-context sessions beside a codec-sized
# reserve with the fastest launch, the teacher-forced quality gate, and the graphed talker against the eager one.
# Each step has its own deadline, so one that hangs leaves the others their time. Results go to $1 (default
# bench/results); the log to $1/kv4.log.
#     bash bench/device.sh bash bench/kv4.sh "$OUT"
set -uo pipefail
out="${1:-bench/results}"
mkdir -p "$out"
log="$out/kv4.log"
export PYTHONUNBUFFERED=1
step() {  # deadline_s, then the command
    local deadline=$1
    shift
    echo "=== $* (deadline ${deadline} s)" | tee -a "$log"
    timeout "$deadline" "$@" 2>&1 | tee -a "$log"
    echo "=== exit ${PIPESTATUS[0]}" | tee -a "$log"
}
step 150 python3 -m bench.attention_check --formats int4 --out "$out"
# The fastest launch that agrees with the reference, of either kernel (bench/attention_check_int4.py); without one
# (the step failed before the sweep), services/talker/kv_int4.py's default.
launch=()
best=$(python3 -c "import json; print(json.load(open('$out/attention_check_int4.json'))['best_launch'])" 2>/dev/null) \
    && launch=(--kv4-launch "$best")
echo "=== 4-bit launch for the talker: ${best:-the default}" | tee -a "$log"
step 160 python3 -m bench.talker --kv-bits 4 --weights-fp8 --compile --batches 1,64,160,288 --extra-batches 304,320 \
    --ref-batches 1,64 --reserve-gb 5.7 "${launch[@]}" --name talker_kv4 --out "$out"
step 150 python3 -m bench.quality --out "$out"
step 55 python3 -m bench.prefill_graph_check --kv-bits 4
