#!/usr/bin/env bash
# The GPU session: every device run of the benchmarks, as sections of one script (one H100 or H200).
#
# Here, first:  SITE=cli bash bench/pack_device.sh   (both ComfyUIs, comfy-kitchen with its CUDA kernels, the peer)
# Then one device call, carry [".carry/comfyui.tar.xz", ".carry/comfyui075.tar.xz", ".carry/peer_reference.py", ".whl"]:
#   bash bench/session.sh "$OUT" SECTION...
# Sections:
#   profile   issue 41: attention kernels at our shapes (bench/attention_backends.py), then a kernel table by op class
#             (bench/profile_steps.py) of the reference peer, of ours on the newest ComfyUI, of ours on ComfyUI
#             0.3.75's classes, and of ours on the newest with attention as ComfyUI would choose it: klein 9B,
#             bf16, recompute all, compiled
#   judge     issue 41's judge: the peer, then ours in each mode and recompute setting (bench/cards.py speed rows)
# Sections run in the order given; a case that would not end inside the call (BUDGET_S) is skipped and says so.
# Every case is its own process and appends its row as it ends (OUT/cases.jsonl: bench/cards.py's rows,
# OUT/speed.jsonl: speed rows beside the peer's), so a call cut short keeps what it measured; OUT/session.log
# has the output; the profile tables go into OUT/profiles.tar. CASE_S bounds each case (s, default 150).
set -u
out=${1:?output folder}; shift
sections=${*:-profile}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
log=$out/session.log
step() { echo "=== $* ($(date +%T))" | tee -a "$log"; }
step "unpack ComfyUI and its requirements"
. bench/device_env.sh
unpack_comfyui || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee -a "$log"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$log"
python3 -c 'import comfy_kitchen as k; print("comfy-kitchen backends:", {n: b["available"] for n, b in k.list_backends().items()})' 2>&1 | tail -1 | tee -a "$log"
echo "ComfyUI $(cat .carry/comfyui/COMMIT)" | tee -a "$log"
call=${CALL:-$(date +%F)/$(hostname | cut -c1-8)}
k9=/tmp/k9.safetensors
klein() { [ -f $k9 ] || { step "klein 9B write"; timeout 150 python3 bench/place_train.py write --model flux2-klein-9b --path $k9 >> "$log" 2>&1; }; }
keep_profile() {  # label: its profile files into OUT/profiles.tar (a device call returns 8 files at most)
  (cd /tmp/prof && tar -rf "$out/profiles.tar" $1.*) && rm -f /tmp/prof/$1.*
}
fits() {          # label: whether a case still fits the call (BUDGET_S, default 570 s, less a case's 100 s)
  (( SECONDS + 100 < ${BUDGET_S:-570} )) && return 0
  echo "skipped $1: the call's time is nearly spent" | tee -a "$log"; return 1
}
case_row() {      # label, comfyui folder, then bench/cards.py arguments (bench/profile_steps.py's with PROFILE=1)
  local label=$1 comfyui=$2; shift 2
  fits $label || return 0
  local wrap=()
  [ -n "${PROFILE:-}" ] && wrap=(bench/profile_steps.py --out /tmp/prof/$label --skip 8 --active 2 ${TRACE:+--trace} --)
  step "case $label"
  COMFYUI_PATH=$comfyui timeout "${CASE_S:-150}" python3 "${wrap[@]}" bench/cards.py --label "$label" \
    --rows "$out/cases.jsonl" --work "/tmp/case_$label" --speed-rows "$out/speed.jsonl" --call "$call" "$@" >> "$log" 2>&1
  echo "rc=$? $label" | tee -a "$log"
  tail -1 "$out/speed.jsonl" 2>/dev/null | python3 -c 'import json,sys; r=json.loads(sys.stdin.read() or "{}"); print({k: r.get(k) for k in ("label","impl","mode","recompute","s_per_step","forecast_s","peak_gib","sm_clock_mhz","comfyui","kitchen_cuda")})' | tee -a "$log"
  [ -n "${PROFILE:-}" ] && { grep -A14 "^# " /tmp/prof/$label.txt | tee -a "$log"; keep_profile $label; }
}
peer() {          # label (the reference peer, compiled; bench/profile_steps.py's with PROFILE=1)
  local label=$1 wrap=()
  fits $label || return 0
  peer_done=1
  [ -n "${PROFILE:-}" ] && wrap=(bench/profile_steps.py --out /tmp/prof/$label --skip 8 --active 2 --)
  step "the reference peer ($label)"
  timeout "${CASE_S:-150}" python3 "${wrap[@]}" .carry/peer_reference.py --out "$out/speed.jsonl" --call "$call" \
    --steps 8 >> "$log" 2>&1
  echo "rc=$? $label" | tee -a "$log"
  tail -1 "$out/speed.jsonl" | tee -a "$log"
  [ -n "${PROFILE:-}" ] && { grep -A14 "^# " /tmp/prof/$label.txt | tee -a "$log"; keep_profile $label; }
}
mkdir -p /tmp/prof
klein
ours="--model-file $k9 --steps 12"
for s in $sections; do
  case $s in
  profile)
    step "attention backends"
    timeout 90 python3 bench/attention_backends.py --rows "$out/attention.jsonl" 2>&1 | tee -a "$log" | tail -12
    PROFILE=1 case_row prof-ours-033-bf16-all "$COMFYUI_PATH" $ours --base-compute bf16 --recompute all
    PROFILE=1 case_row prof-ours-033-bf16-all-comfy-attention "$COMFYUI_PATH" $ours --base-compute bf16 \
      --recompute all --experiment comfy-attention
    PROFILE=1 case_row prof-ours-075-bf16-all "$COMFYUI_075" $ours --base-compute bf16 --recompute all
    PROFILE=1 peer prof-peer ;;
  judge)           # (after profile in the same call: its bf16 rows and its peer stand)
    [ -n "${peer_done:-}" ] || peer judge-peer
    [ -n "${peer_done:-}" ] || case_row judge-bf16-all "$COMFYUI_PATH" $ours --base-compute bf16 --recompute all
    for m in fp8 int8; do case_row judge-$m-all "$COMFYUI_PATH" $ours --base-compute $m --recompute all; done
    case_row judge-bf16-auto "$COMFYUI_PATH" $ours --base-compute bf16 --recompute auto
    case_row judge-fp8-auto "$COMFYUI_PATH" $ours --base-compute fp8 --recompute auto
    case_row judge-bf16-auto-24 "$COMFYUI_PATH" $ours --base-compute bf16 --recompute auto --card-gib 24 ;;
  *) echo "unknown section $s" | tee -a "$log" ;;
  esac
done
step done
