#!/usr/bin/env bash
# One call on a machine with two GPUs (device kind nvidia-h200-x2 or nvidia-h100-x2): replicas against the split
# (issue 40), most important first, every step under a timeout drawn from one budget (BUDGET_S, default 570 s,
# inside the call's 600 s). Each measurement appends its rows to OUTDIR/two_gpu.jsonl as it ends, so a call cut
# short keeps what finished.
#
#   COMFYUI_PATH=<a ComfyUI checkout> bash bench/h200x2_session.sh OUTDIR
#   DEVICES=cpu,cpu PROFILE=tiny-flux2 bash bench/h200x2_session.sh OUTDIR        # smoke, no model file
set -u
out=${1:?output folder}
devices=${DEVICES:-cuda:0,cuda:1}
profile=${PROFILE:-klein-9b-1024}
budget=${BUDGET_S:-570}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
step() { echo "=== $* ($(date +%T), $(left) s left)"; }
# bench CAP ARGS...: bench/two_gpu.py for at most min(CAP, time left) seconds (skipped under 20 s)
bench() {
  local cap=$1; shift
  local t; t=$(left); (( t > cap )) && t=$cap
  if (( t < 20 )); then echo "skipped, out of time: $*"; return 0; fi
  timeout -k 5 "$t" python3 bench/two_gpu.py --profile "$profile" --devices "$devices" \
    --rows "$out/two_gpu.jsonl" --work /tmp/two_gpu "$@"
  echo "(exit $?)"
}

nvidia-smi --query-gpu=index,name,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv 2>/dev/null
nvidia-smi topo -m 2>/dev/null
model=()
if [ "$profile" = klein-9b-1024 ]; then
  step "klein 9B base: random checkpoint to /tmp"
  [ -f /tmp/k9-base.safetensors ] || timeout 90 python3 bench/place_train.py write --model flux2-klein-base-9b \
    --path /tmp/k9-base.safetensors
  model=(--model-file /tmp/k9-base.safetensors)
fi
step "$profile: the split against 2 replicas at 2 micro-batches a step"
bench 200 "${model[@]}" --grad-accum 2 --steps 8
step "$profile: the split against 2 replicas at 4 and 8 micro-batches a step"
bench 300 "${model[@]}" --grad-accum 4,8 --steps 6
step "done"
cat "$out/two_gpu.jsonl" 2>/dev/null | grep '"compare"'
