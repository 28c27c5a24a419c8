#!/usr/bin/env bash
# Issue 29 on the device (one H100 or H200): the planner's memory and time model against real runs of
# `python -m ugpum train` (bench/cards.py, one process per case), on the newest ComfyUI's model classes.
#
# Here, first:  bash bench/pack_device.sh      (ComfyUI + the wheels the image lacks; see its header)
# Then one device call, carry [".carry/comfyui.tar.xz", ".whl"]:
#   bash bench/calibration_session.sh "$OUT" SECTION...
# Sections (each case appends one JSON row to OUT/calibration.jsonl as it ends, so a call cut short keeps
# what it measured; the log is OUT/session.log):
#   fit       what the memory model is fitted to (bench/memory_fit.py reads the rows): klein 9B with every
#             block keeping its activations, compiled bf16 / fp8 / int8 and eager bf16, with the bytes each
#             block keeps read off the allocator (cards.py's BlockMemory); an 8 and a 16 GiB card as planned
#   klein     klein 9B, base compute auto + recompute auto, on cards of 8, 10, 12, 16, 24, 32 GiB and the whole GPU,
#             then the planner's pick against its neighbours on 12, 16 and 24 GiB cards (CARDS overrides the list)
#   wan       Wan 2.1 14B (17 frames at 640², the area of 832x480) on 16 and 24 GiB cards
# CASE_S bounds each case (s, default 170).
set -u
out=${1:?output folder}; shift
sections=${*:-klein}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
log=$out/session.log
step() { echo "=== $* ($(date +%T))" | tee -a "$log"; }
step "unpack ComfyUI and its requirements"
. bench/device_env.sh
unpack_comfyui || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee -a "$log"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$log"
echo "ComfyUI $(cat .carry/comfyui/COMMIT)" | tee -a "$log"
rows=$out/calibration.jsonl
run_case() {      # label, then bench/cards.py arguments
  local label=$1; shift
  step "case $label"
  timeout "${CASE_S:-170}" python3 bench/cards.py --label "$label" --rows "$rows" --work "/tmp/cards_$label" "$@" \
    >> "$log" 2>&1
  echo "rc=$? $label" | tee -a "$log"
  tail -1 "$rows" 2>/dev/null | python3 -c 'import json,sys; r=json.loads(sys.stdin.read() or "{}"); print({k: r.get(k) for k in ("label","rc","s_per_step","forecast_s","peak_reserved_gib","peak_gib","forecast_gib","host_peak_gib","swapped_blocks","kept_blocks")})' | tee -a "$log"
}
k9=/tmp/k9.safetensors
w14=/tmp/w14.safetensors
klein() { [ -f $k9 ] || { step "klein 9B write"; timeout 150 python3 bench/place_train.py write --model flux2-klein-9b --path $k9 >> "$log" 2>&1; }; }
wan() { [ -f $w14 ] || { step "Wan 14B write"; timeout 200 python3 bench/place_train.py write --model wan2.1-14b --path $w14 >> "$log" 2>&1; }; }
wan_args="--resolution 640 --frames 17 --rank 32 --dataset demo_datasets/loranne_clips"
for s in $sections; do
  case $s in
  fit) klein
    run_case fit-none-bf16 --model-file $k9 --base-compute bf16 --recompute none --steps 6
    run_case fit-none-fp8 --model-file $k9 --base-compute fp8 --recompute none --steps 6
    run_case fit-8 --model-file $k9 --card-gib 8 --steps 12
    run_case fit-16 --model-file $k9 --card-gib 16 --recompute auto --steps 12
    run_case fit-none-int8 --model-file $k9 --base-compute int8 --recompute none --steps 6
    run_case fit-none-bf16-eager --model-file $k9 --base-compute bf16 --recompute none --steps 6 --compile off ;;
  fitwan) wan
    run_case fitwan-auto-fp8 --model-file $w14 --base-compute fp8 --recompute auto --steps 6 $wan_args ;;
  klein) klein
    # CARDS: card sizes in GiB (whole: the GPU uncapped), and neighbours of the planner's pick as CARD:VARIANT
    # (kept+2 kept-2 swapped+2 swapped-2: bench/cards.py --variant), in the order given
    for card in ${CARDS:-8 10 12 16 24 32 whole 12:swapped+2 12:swapped-2 16:kept+2 16:kept-2 24:kept+2 24:kept-2}; do
      size=${card%%:*}
      cap=$([ $size = whole ] || echo "--card-gib $size")
      if [ "$size" = "$card" ]; then
        run_case klein-$card --model-file $k9 $cap --recompute auto --steps 12 --choice planner
      else
        run_case klein-$size-${card#*:} --model-file $k9 $cap --recompute auto --steps 12 --choice neighbour \
          --variant ${card#*:} --of klein-$size
      fi
    done ;;
  wan) wan
    for card in 16 24; do
      run_case wan-$card --model-file $w14 --card-gib $card --recompute auto --steps 12 $wan_args --choice planner
    done ;;
  esac
done
step done
