#!/usr/bin/env bash
# One call on a machine with two H200s (device kind nvidia-h200-x2): the two-GPU benchmark of issue 7,
# most important first, every step under a timeout drawn from one budget (BUDGET_S, default 570 s,
# inside the call's 600 s). Each run merges its entries into OUTDIR/two_gpu.{json,md} as it ends, so a
# call cut short keeps what finished; a run still going when its time is up is recorded as timed out.
#
#   COMFYUI_PATH=<a ComfyUI checkout> bash bench/h200x2_session.sh OUTDIR
#   DEVICES=cuda:0,cuda:0 COMFYUI_PATH=... bash bench/h200x2_session.sh OUTDIR   # one-GPU trial (one H200)
#   DEVICES=cpu,cpu BENCH_ARGS="--model tiny-flux2 --resolution 64 --text-tokens 8 --rank 2" bash ...   # smoke
#
# The one-GPU trial puts both stages on cuda:0 with the caps summed: it shows everything runs within
# the caps; its speed-ups and copy figures mean nothing (one GPU's compute, no copy between stages).
set -u
out=${1:?output folder}
devices=${DEVICES:-cuda:0,cuda:1}
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
  # shellcheck disable=SC2086  # BENCH_ARGS: extra arguments, split on spaces
  timeout -k 5 $(( t + 10 )) python3 bench/two_gpu.py --devices "$devices" --ckpt-dir /tmp --keep-ckpt \
    --out "$out" --time-limit-s "$t" ${BENCH_ARGS:-} "$@"
  echo "(exit $?)"
}

nvidia-smi --query-gpu=index,name,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv
nvidia-smi topo -m
python3 -c "import torch; print('torch', torch.__version__, 'peer 0->1:', torch.cuda.device_count() > 1 and torch.cuda.can_device_access_peer(0, 1))"

step "Wan 2.1 14B: random checkpoint (26.6 GiB) to /tmp"
bench 110 --cases wan_split --write-only
step "Wan 14B, one 1024² frame: split over two GPUs capped at 16 GiB (m = 1, 4, the schedule training picks) vs one GPU capped at 16 GiB with swap"
bench 150 --cases wan_split --only wan_split/split,wan_split/swap --steps 3
step "klein 9B: random checkpoint (16.9 GiB) to /tmp"
bench 75 --cases klein_schedules --write-only
step "klein 9B at 1024²: one GPU unconstrained vs the split at m = 1, 2, 4, 8 with each schedule"
bench 200 --cases klein_schedules --micro-batches 1,2,4,8 --steps 3
step "klein 9B, caps 16 and 8 GiB: the planner's split vs an even split (m = 4)"
bench 90 --cases mixed_caps --steps 3
step "klein 9B split: GPU-to-GPU copies direct vs staged through pinned host memory (m = 1, 4), raw bandwidth"
bench 70 --cases staged_copies --steps 3
step "experiment: Wan 14B split at 2x16 GiB, 1f1b forced over the swapped stages (m = 4)"
bench 80 --cases wan_split --only wan_split/split_1f1b --steps 3
rm -f /tmp/wan2.1-14b.safetensors /tmp/flux2-klein-9b.safetensors /tmp/tiny-flux2.safetensors
t=$(left)
if (( t > 40 )); then
  step "CUDA tests of the staged copies (two GPUs: a split trains the same either way)"
  timeout "$(( t - 5 ))" python3 -m pytest -q -p no:cacheprovider tests/test_two_gpu_bench.py -k "staged or split_trains or gpu" 2>&1 | tail -4
fi
step "done"
sed -n '/^## Targets/,/^## Runs/p' "$out/two_gpu.md" 2>/dev/null
