#!/usr/bin/env bash
# The GPU session: every device run of the benchmarks, as sections of this one script (one H100 or H200; the
# two-gpu section two GPUs). Each case is `python -m ugpum train` (bench/cards.py) or the nodes in a real
# ComfyUI, on full-size random-weight files in the real layouts (bench/model_files.py).
#
# Here, first, the pack for the sections asked (bench/pack_device.sh's header says what each holds):
#   SITE=cli bash bench/pack_device.sh      profile eight-bit judge wan-judge cards wan-cards fit cuda-tests before-after
#   bash bench/pack_device.sh               nodes (the ComfyUI server's requirements)
#   BEFORE=REF SITE=cli bash bench/pack_device.sh      before-after (REF's tree too)
#   CLIPS=1 SITE=cli bash bench/pack_device.sh      wan-judge wan-cards (the demo clips as frames: no PyAV)
# Then one device call, carry [".carry/comfyui.tar.xz", ".carry/comfyui075.tar.xz", ".carry/peer_reference.py",
# ".whl"] (and ".carry/before.tar.xz" for before-after, ".carry/loranne_frames.tar" for Wan without PyAV):
#   bash bench/session.sh "$OUT" SECTION...
# Sections, run in the order given:
#   profile     a kernel table by op class
#               (bench/profile_steps.py) of ours on the newest ComfyUI, of ours as ComfyUI 0.33 would choose
#               attention, of ours on ComfyUI 0.3.75's classes, of the reference peer (klein 9B, bf16, recompute
#               all; ours' timeline kept too)
#   eight-bit   ours with the int8 and the fp8 base (recompute all) under inductor's GEMM autotuning
#               (bench/cards.py --experiment gemm-autotune: the rescale in the matmul's epilogue)
#   gemm-8bit   the 8-bit GEMMs of a klein 9B step alone: cuBLAS fp8, _int_mm, our int8 kernel with and without
#               the tensor memory accelerator, tiles, LoRA epilogue, weight transposes (bench/gemm_8bit.py)
#   kernel-ab   ours, recompute all, as it runs and with an experiment: KERNEL_AB's MODE:EXPERIMENT pairs
#               (bench/cards.py --experiment plain-ops | lora-kernel | int8-kernel: no kernel, or that kernel alone;
#               int8-lora-epilogue: the int8 kernel adds the LoRA's up-projection)
#   trace       the peer, then ours in bf16 and fp8 (recompute all) with their kernel tables and timelines
#   judge       the peer, then ours in each base-compute mode and recompute setting (issue 41's rows; the
#               recompute-all rows' kernel tables kept unless NO_PROFILE; JUDGE: which rows, MODE-RECOMPUTE[-CARD GiB][@EXPERIMENT])
#   wan-judge   Wan 2.1 14B at 640² x 17 frames: a diffusers + PEFT peer (bench/peer_wan.py), then ours
#   cards       klein 9B, base compute auto + recompute auto, as the cards people own (CARDS: sizes in GiB,
#               `whole`, or CARD:VARIANT neighbours of the planner's pick: kept+2 swapped-2 ...)
#   wan-cards   Wan 2.1 14B (640² x 17 frames, rank 32) on 16 and 24 GiB cards, as planned
#   wan-long    Wan 2.1 14B, 81 frames of the clips (832x480 buckets at 640²) on a 24 GiB card as planned (its
#               recomputed blocks' inputs wait in host memory: Workload.inputs_on_host)
#   dev-card    FLUX.2 [dev] 32B, fp8 weights, on a 24 GiB card as planned (base compute and recompute auto)
#   fit         what the planner's memory and time model is fitted to (bench/calibration_fit.py reads the rows;
#               FITS: which of none-bf16 none-fp8 none-int8 none-bf16-eager 8 16 wan, all by default)
#   cuda-tests  the tests that run on CUDA when it is there
#   nodes       the node tests in ComfyUI's default GPU mode (DynamicVRAM, cudaMallocAsync as they come)
#   before-after  the whole-GPU and 16 GiB klein cases on REF's tree and on this one; the whole GPU's before
#               after after before (BA_ORDER): the same tree twice gives the A/A noise
#   one-process what one process costs driving two replicas: two workers against one on cuda:0
#               (bench/two_gpu.py --layouts one,replicas)
#   two-gpu     replicas against the split on two GPUs (bench/two_gpu.py)
#   cosine      each 8-bit mode's per-block LoRA gradient cosine against the bf16 base, klein 9B's first, middle
#               and last block (bench/gradient_cosine.py, OUT/gradient_cosine.jsonl; the modes' gradient_cosine)
# Each case is its own process and appends its row as it ends (OUT/cases.jsonl: bench/cards.py's rows,
# OUT/speed.jsonl: speed rows beside the peers'), so a call cut short keeps what it measured; a case that would
# not end inside the call (BUDGET_S, default 570 s) is skipped and says so. OUT/session.log has the output, the
# profile tables go into OUT/profiles.tar (a device call returns 8 files at most). CASE_S bounds each case.
set -u
out=${1:?output folder}; shift
sections=${*:-profile}
mkdir -p "$out" /tmp/prof
export PYTHONUNBUFFERED=1
# the allocator's settings `python -m ugpum train` runs with, also for REF's tree (its cards.py capped the card first)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
log=$out/session.log
step() { echo "=== $* ($(date +%T))" | tee -a "$log"; }
step "unpack ComfyUI and its requirements"
. bench/device_env.sh
unpack_comfyui || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee -a "$log"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$log"
python3 -c 'import comfy_kitchen as k; print("comfy-kitchen backends:", {n: b["available"] for n, b in k.list_backends().items()})' 2>&1 | tail -1 | tee -a "$log"
echo "ComfyUI $(cat .carry/comfyui/COMMIT)" | tee -a "$log"
call=${CALL:-$(date +%F)/$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -cd 'A-Za-z0-9')}
k9=/tmp/k9.safetensors
w14=/tmp/w14.safetensors
model_file() {    # path, model id[, stored dtype]
  [ -f "$1" ] || { step "write $2"; timeout 200 python3 bench/model_files.py dit --model "$2" --path "$1" \
    --dtype "${3:-bf16}" >> "$log" 2>&1; }
}
fits() {          # label: whether a case still fits the call (BUDGET_S, less a case's RESERVE_S, 100 s)
  (( SECONDS + ${RESERVE_S:-100} < ${BUDGET_S:-570} )) && return 0
  echo "skipped $1: the call's time is nearly spent" | tee -a "$log"; return 1
}
profiled() {      # label: bench/profile_steps.py's wrapper when PROFILE is set
  [ -n "${PROFILE:-}" ] && echo bench/profile_steps.py --out /tmp/prof/$1 --skip 8 --active 2 ${TRACE:+--trace} --
}
kept_profile() {  # label: its table into the log, its files into OUT/profiles.tar
  [ -n "${PROFILE:-}" ] && [ -f /tmp/prof/$1.txt ] || return 0
  grep -A14 "^# " /tmp/prof/$1.txt | tee -a "$log"
  mv /tmp/prof/$1.trace.json.gz "$out/" 2>/dev/null          # a file of its own: a call returns 16 MB a file
  (cd /tmp/prof && tar -rf "$out/profiles.tar" $1.*) && rm -f /tmp/prof/$1.*
}
case_row() {      # label, comfyui folder, then bench/cards.py arguments
  local label=$1 comfyui=$2; shift 2
  fits $label || return 0
  step "case $label"
  COMFYUI_PATH=$comfyui timeout "${CASE_S:-150}" python3 $(profiled $label) bench/cards.py --label "$label" \
    --rows "$out/cases.jsonl" --work "/tmp/case_$label" --speed-rows "$out/speed.jsonl" --call "$call" "$@" >> "$log" 2>&1
  echo "rc=$? $label" | tee -a "$log"
  tail -1 "$out/cases.jsonl" 2>/dev/null | python3 -c 'import json,sys; r=json.loads(sys.stdin.read() or "{}"); print({k: r.get(k) for k in ("label","base_compute","recompute","s_per_step","forecast_s","peak_reserved_gib","forecast_gib","host_peak_gib","forecast_host_gib","swapped_blocks","kept_blocks","kitchen_cuda")})' | tee -a "$log"
  kept_profile $label
}
peer() {          # label, then the peer script and its arguments
  local label=$1; shift
  fits $label || return 0
  step "peer $label"
  timeout "${CASE_S:-150}" python3 $(profiled $label) "$@" --out "$out/speed.jsonl" --call "$call" >> "$log" 2>&1
  echo "rc=$? $label" | tee -a "$log"
  tail -1 "$out/speed.jsonl" | tee -a "$log"
  kept_profile $label
}
ours="--model-file $k9 --steps 12"
clips=demo_datasets/loranne_clips
if ! python3 -c "import av" 2>/dev/null && [ -f .carry/loranne_frames.tar ]; then   # SITE=cli has no PyAV
  tar -C /tmp -xf .carry/loranne_frames.tar && clips=/tmp/loranne_frames
fi
wan_args="--model-file $w14 --resolution 640 --frames 17 --rank 32 --dataset $clips"
for s in $sections; do
  case $s in
  profile) model_file $k9 flux2-klein-9b
    PROFILE=1 TRACE=1 case_row prof-ours-bf16-all "$COMFYUI_PATH" $ours --base-compute bf16 --recompute all
    PROFILE=1 case_row prof-ours-bf16-all-comfy-attention "$COMFYUI_PATH" $ours --base-compute bf16 \
      --recompute all --experiment comfy-attention
    PROFILE=1 case_row prof-ours-075-bf16-all "$COMFYUI_075" $ours --base-compute bf16 --recompute all
    PROFILE=1 peer prof-peer .carry/peer_reference.py --steps 8
    peer_done=1 ;;
  eight-bit) model_file $k9 flux2-klein-9b
    for m in int8 fp8; do          # (autotuning every GEMM shape took over 200 s for int8 on 2026-12-07)
      CASE_S=${AUTOTUNE_S:-360} RESERVE_S=${AUTOTUNE_S:-360} case_row autotune-$m-all "$COMFYUI_PATH" $ours --base-compute $m --recompute all \
        --experiment gemm-autotune
    done ;;
  judge) model_file $k9 flux2-klein-9b
    [ -n "${peer_done:-}" ] || peer judge-peer .carry/peer_reference.py --steps 8
    # rows MODE-RECOMPUTE[-CARD GiB][@EXPERIMENT]; those of recompute all with their kernel tables (the median
    # step of the other 8)
    for r in ${JUDGE:-bf16-all fp8-all int8-all bf16-auto fp8-auto bf16-auto-24}; do
      IFS=- read -r m rec card <<< "${r%@*}"
      x=$([ "$r" = "${r%@*}" ] || echo "--experiment ${r#*@}")
      PROFILE=$([ $rec = all ] && [ -z "${NO_PROFILE:-}" ] && echo 1) case_row judge-${r/@/-} "$COMFYUI_PATH" $ours \
        --base-compute $m --recompute $rec ${card:+--card-gib $card} $x
    done ;;
  gemm-8bit) step "the 8-bit GEMMs alone"
    timeout 240 python3 bench/gemm_8bit.py --rows "$out/gemm_8bit.jsonl" 2>&1 | tee -a "$log" | tail -20 ;;
  kernel-ab) model_file $k9 flux2-klein-9b  # ours without and with a kernel of ugpum.compute.kernels, mode by mode
    for pair in ${KERNEL_AB:-int8:int8-lora-epilogue fp8:plain-ops}; do
      m=${pair%%:*} x=${pair#*:}
      case_row ab-$m-all "$COMFYUI_PATH" $ours --base-compute $m --recompute all
      case_row ab-$m-all-$x "$COMFYUI_PATH" $ours --base-compute $m --recompute all --experiment $x
    done ;;
  trace) model_file $k9 flux2-klein-9b      # the peer, then ours with the timeline (where the GPU waits for the host)
    [ -n "${peer_done:-}" ] || peer judge-peer .carry/peer_reference.py --steps 8
    peer_done=1
    for m in bf16 fp8; do PROFILE=1 TRACE=1 case_row trace-$m-all "$COMFYUI_PATH" $ours --base-compute $m --recompute all; done ;;
  wan-judge) model_file $w14 wan2.1-14b
    peer wan-peer bench/peer_wan.py --width 640 --height 640 --frames 17
    case_row wan-bf16-all "$COMFYUI_PATH" $wan_args --steps 8 --base-compute bf16 --recompute all ;;
  cards) model_file $k9 flux2-klein-9b
    for card in ${CARDS:-8 10 12 16 24 32 whole 12:swapped+2 12:swapped-2 16:kept+2 16:kept-2 24:kept+2 24:kept-2}; do
      size=${card%%:*}
      cap=$([ $size = whole ] || echo "--card-gib $size")
      if [ "$size" = "$card" ]; then
        case_row klein-$card "$COMFYUI_PATH" $ours $cap --recompute auto --choice planner
      else
        case_row klein-$size-${card#*:} "$COMFYUI_PATH" $ours $cap --recompute auto --choice neighbour \
          --variant ${card#*:} --of klein-$size
      fi
    done ;;
  wan-cards) model_file $w14 wan2.1-14b
    for card in 16 24; do
      case_row wan-$card "$COMFYUI_PATH" $wan_args --card-gib $card --recompute auto --steps 12 --choice planner
    done ;;
  wan-long) model_file $w14 wan2.1-14b    # 81 frames: the clips' 33 frames over again (needs the CLIPS pack)
    long=/tmp/loranne_frames81
    ls -d "$clips"/*/ > /dev/null 2>&1 || { echo "skipped wan-long: the clips are no frame folders (CLIPS=1 pack)" | tee -a "$log"; continue; }
    for d in "$clips"/*/; do
      n=$(basename "$d"); files=("$d"*.jpg); mkdir -p "$long/$n" && cp "$clips/$n.txt" "$long/"
      for k in $(seq 0 80); do cp "${files[$((k % ${#files[@]}))]}" "$long/$n/$(printf %04d $((k + 1))).jpg"; done
    done
    CASE_S=${LONG_S:-420} RESERVE_S=${LONG_S:-420} case_row wan-long-24 "$COMFYUI_PATH" --model-file $w14 \
      --resolution 640 --frames 81 --rank 32 --dataset $long --card-gib 24 --recompute auto --steps 8 --choice planner ;;
  dev-card) rm -f $w14 /tmp/k9-base.safetensors     # the disk (64 GiB) holds klein's and this 30 GiB file, no more
    model_file /tmp/f2d.safetensors flux2-dev fp8
    case_row dev-24 "$COMFYUI_PATH" --model-file /tmp/f2d.safetensors --weight-dtype fp8 --card-gib 24 \
      --recompute auto --steps 10 --choice planner ;;
  fit) for f in ${FITS:-none-bf16 none-fp8 none-int8 none-bf16-eager 8 16 wan}; do
      [ $f = wan ] || model_file $k9 flux2-klein-9b
      case $f in
      none-bf16-eager) case_row fit-$f "$COMFYUI_PATH" --model-file $k9 --steps 6 --base-compute bf16 --recompute none \
          --compile off ;;
      none-*) case_row fit-$f "$COMFYUI_PATH" --model-file $k9 --steps 6 --base-compute ${f#none-} --recompute none ;;
      wan) model_file $w14 wan2.1-14b        # Wan's kept blocks, no swap (the whole GPU keeps 31 of 40)
        case_row fit-wan "$COMFYUI_PATH" $wan_args --steps 6 --base-compute fp8 --recompute auto ;;
      *) case_row fit-$f "$COMFYUI_PATH" $ours --card-gib $f --recompute auto ;;
      esac
    done ;;
  cuda-tests) step "the tests that run on CUDA"
    timeout ${TESTS_S:-280} python3 -m pytest -q -p no:cacheprovider tests/unit/test_swap_8bit.py tests/unit/test_place.py \
      tests/integration/test_train.py -k "cuda or gpu" 2>&1 | tail -15 | tee -a "$log" ;;
  nodes) step "the node tests, ComfyUI in its GPU mode"
    UGPUM_TEST_COMFYUI_GPU=1 timeout ${TESTS_S:-280} python3 -m pytest -q -p no:cacheprovider -rfE \
      tests/server/test_comfy_nodes.py 2>&1 | tail -15 | tee -a "$log" ;;
  before-after) model_file $k9 flux2-klein-9b
    rm -rf /tmp/before && tar -C /tmp -xJf .carry/before.tar.xz || exit 1
    n=0
    for card in whole 16; do             # whole: before, after, after, before (the repeats give the A/A noise)
      # the base compute both trees' auto took (auto weighs every mode since issue 38): the same plans
      cap=$([ "$card" = whole ] && echo "--base-compute bf16" || echo "--card-gib $card --base-compute fp8")
      order=$([ "$card" = whole ] && echo "${BA_ORDER:-before after after before}" || echo "before after")
      for tree in $order; do
        n=$((n + 1)); fits "$tree-klein-$card" || continue
        root=$([ $tree = before ] && echo /tmp/before || echo "$PWD")
        step "$tree: klein-$card"
        (cd "$root" && COMFYUI_PATH=$COMFYUI_PATH timeout "${CASE_S:-150}" python3 bench/cards.py --label "$tree-klein-$card-$n" \
          --rows "$out/cases.jsonl" --work /tmp/ba_${tree}_${card}_$n --dataset "$OLDPWD/demo_datasets/loranne" \
          --model-file $k9 --steps 12 $cap --recompute auto --choice planner >> "$log" 2>&1)
        echo "rc=$? $tree klein-$card" | tee -a "$log"
      done
    done ;;
  one-process) fits one-process || continue
    model_file /tmp/k9-base.safetensors flux2-klein-base-9b
    step "one process driving two replicas of klein 9B on cuda:0 against one worker"
    timeout ${CASE_S:-300} python3 bench/two_gpu.py --model-file /tmp/k9-base.safetensors --devices cuda:0,cuda:0 \
      --layouts one,replicas --grad-accum 2 --rows "$out/one_process.jsonl" --work /tmp/one_process >> "$log" 2>&1
    echo "rc=$? one-process" | tee -a "$log" ;;
  two-gpu) model_file /tmp/k9-base.safetensors flux2-klein-base-9b
    step "replicas against the split, 2, 4 and 8 micro-batches a step"
    timeout ${TWO_GPU_S:-500} python3 bench/two_gpu.py --model-file /tmp/k9-base.safetensors --devices cuda:0,cuda:1 \
      --grad-accum 2,4,8 --rows "$out/two_gpu.jsonl" --work /tmp/two_gpu >> "$log" 2>&1
    echo "rc=$? two-gpu" | tee -a "$log" ;;
  cosine) fits cosine || continue
    model_file $k9 flux2-klein-9b
    step "LoRA gradient cosine of each 8-bit mode against bf16, klein 9B's first, middle and last block"
    timeout ${CASE_S:-300} python3 bench/gradient_cosine.py --model-file $k9 --device cuda:0 \
      --rows "$out/gradient_cosine.jsonl" >> "$log" 2>&1
    echo "rc=$? cosine" | tee -a "$log" ;;
  *) echo "unknown section $s" | tee -a "$log" ;;
  esac
done
step done
