#!/usr/bin/env bash
# One H200 call: CUDA unit tests, then the placement/forecast, engine and swap benchmarks, most
# important first (a call that runs out of time still returns what is written under OUTDIR).
# Usage on the device machine: COMFYUI_PATH=<a ComfyUI checkout> bash bench/h200_session.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
step() { echo "=== $* ($(date +%T))"; }
step "CUDA unit tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_place.py tests/test_swap.py tests/test_pipeline.py 2>&1 | tail -4
step "klein 9B checkpoint"
timeout 90 python3 bench/place_train.py write --model flux2-klein-9b --path /tmp/k9.safetensors
step "klein 9B placement, 1024"
timeout 120 python3 bench/place_train.py run --path /tmp/k9.safetensors --resolution 1024 --steps 5 --out "$out/klein9b_1024.json"
step "klein 9B: 20 training steps through the engine (python -m ugpum train)"
timeout 150 python3 -m ugpum train --profile klein-9b-1024 --model /tmp/k9.safetensors --dataset demo_datasets/loranne \
  --steps 20 --stand-in-encoders --sample-every 0 --out /tmp/train_klein > "$out/train_klein.log" 2>&1
tail -4 "$out/train_klein.log"; cp /tmp/train_klein/metrics.jsonl "$out/train_klein_metrics.jsonl"
step "Wan 14B checkpoint"
timeout 120 python3 bench/place_train.py write --model wan2.1-14b --path /tmp/w14.safetensors
step "Wan 14B placement, one 1024 frame"
timeout 150 python3 bench/place_train.py run --path /tmp/w14.safetensors --resolution 1024 --steps 4 --out "$out/wan14b_1024.json"
rm -f /tmp/w14.safetensors
step "klein 9B swap at 16 GiB"
# each case in its own process: in one process the capped case ran out of its 15.5 GiB while the
# unconstrained case's 16 GiB of weights were still held (2026-12-03)
timeout 120 python3 bench/swap.py --model flux2-klein-9b --cap-gib 16 --steps 6 --out "$out" --ckpt /tmp/k9.safetensors --keep-ckpt --cases unconstrained
timeout 180 python3 bench/swap.py --model flux2-klein-9b --cap-gib 16 --steps 6 --out "$out" --ckpt /tmp/k9.safetensors --keep-ckpt --cases swap
if [ "${WITH_PIPELINE:-0}" = 1 ]; then
  step "pipeline: two stages on one GPU vs unsplit"
  timeout 300 python3 bench/pipeline.py --model flux2-klein-9b --out "$out"
fi
step "done"
