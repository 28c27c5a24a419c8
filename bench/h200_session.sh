#!/usr/bin/env bash
# H200 sessions: each section is one benchmark group, most important first within a call (a call
# that runs out of time still returns what is written under OUTDIR). Random-weight checkpoints go to
# /tmp and are reused by later sections of the same call.
# Usage on the device machine:
#   COMFYUI_PATH=<a ComfyUI checkout> bash bench/h200_session.sh OUTDIR [SECTION ...]
# Sections: tests place train wan_place swap_klein pipeline swap_wan dev_fp8 wan_clip te_split two_gpu_trial
# (default: the first seven, in that order)
set -u
out=${1:?output folder}; shift
sections=${*:-tests place train wan_place swap_klein pipeline swap_wan}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
step() { echo "=== $* ($(date +%T))"; }
klein_ckpt() { [ -f /tmp/k9.safetensors ] || timeout 90 python3 bench/place_train.py write --model flux2-klein-9b --path /tmp/k9.safetensors; }
wan_ckpt() { [ -f /tmp/w14.safetensors ] || timeout 120 python3 bench/place_train.py write --model wan2.1-14b --path /tmp/w14.safetensors; }
swap_cases() {  # model ckpt extra-args...: each case in its own process — in one process the capped
  # case ran out of its budget while the unconstrained case's weights were still held (2026-12-03)
  local model=$1 ckpt=$2; shift 2
  timeout 150 python3 bench/swap.py --model "$model" --cap-gib 16 --steps 6 --out "$out" --ckpt "$ckpt" --keep-ckpt --cases unconstrained "$@"
  timeout 200 python3 bench/swap.py --model "$model" --cap-gib 16 --steps 6 --out "$out" --ckpt "$ckpt" --keep-ckpt --cases swap "$@"
}
for s in $sections; do
  case $s in
  tests) step "CUDA unit tests"
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_place.py tests/test_swap.py tests/test_pipeline.py 2>&1 | tail -4 ;;
  place) step "klein 9B placement, 1024"; klein_ckpt
    timeout 120 python3 bench/place_train.py run --path /tmp/k9.safetensors --resolution 1024 --steps 5 --out "$out/klein9b_1024.json" ;;
  train) step "klein 9B: 20 training steps through the engine (python -m ugpum train)"; klein_ckpt
    timeout 150 python3 -m ugpum train --profile klein-9b-1024 --model /tmp/k9.safetensors --dataset demo_datasets/loranne \
      --steps 20 --stand-in-encoders --sample-every 0 --out /tmp/train_klein > "$out/train_klein.log" 2>&1
    tail -4 "$out/train_klein.log"; cp /tmp/train_klein/metrics.jsonl "$out/train_klein_metrics.jsonl" ;;
  wan_place) step "Wan 14B placement, one 1024 frame"; wan_ckpt
    timeout 150 python3 bench/place_train.py run --path /tmp/w14.safetensors --resolution 1024 --steps 4 --out "$out/wan14b_1024.json" ;;
  swap_klein) step "klein 9B swap at 16 GiB"; klein_ckpt
    swap_cases flux2-klein-9b /tmp/k9.safetensors ;;
  pipeline) step "pipeline: two stages on one GPU vs unsplit"
    timeout 300 python3 bench/pipeline.py --model flux2-klein-9b --out "$out" ;;
  swap_wan) step "Wan 14B swap at 16 GiB"; wan_ckpt
    swap_cases wan2.1-14b /tmp/w14.safetensors ;;
  dev_fp8) step "FLUX.2 dev, fp8 weights: one placed training run at 1024"
    timeout 120 python3 bench/place_train.py write --model flux2-dev --dtype fp8 --path /tmp/dev_fp8.safetensors
    timeout 150 python3 bench/place_train.py run --path /tmp/dev_fp8.safetensors --resolution 1024 --checkpointing block \
      --steps 4 --out "$out/flux2dev_fp8_place.json"
    rm -f /tmp/dev_fp8.safetensors ;;                # the disk holds only one of the large files at a time
  wan_clip) step "Wan 14B, one 832x480 clip of 17 frames"; wan_ckpt
    timeout 150 python3 bench/place_train.py run --path /tmp/w14.safetensors --resolution 832x480 --frames 17 \
      --checkpointing block --steps 3 --out "$out/wan14b_832x480x17_place.json" ;;
  te_split) step "text-encoder split tests on CUDA (cuda:0 and cpu stages)"
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_text_encoder_split.py 2>&1 | tail -3 ;;
  two_gpu_trial) step "one process driving two replicas of klein 9B on cuda:0 against one (issue 40)"; klein_ckpt
    timeout 300 python3 bench/replicas_one_process.py --model-file /tmp/k9.safetensors --device cuda:0 \
      --rows "$out/replicas_one_process.jsonl" ;;
  *) echo "unknown section $s" ;;
  esac
done
step "done"
