#!/usr/bin/env bash
# Does a restructuring change what a training step costs? The same bench/cards.py cases, run alternately on
# an earlier commit's tree and on this one, in one device call (one GPU, the same clocks).
#
# Here, first:
#   bash bench/pack_device.sh                                   (ComfyUI + the wheels the image lacks)
#   bash bench/before_after.sh --pack REF                       (REF's tree -> .carry/before.tar.xz)
# Then one device call, carry [".carry/comfyui.tar.xz", ".whl", ".carry/before.tar.xz"]:
#   bash bench/before_after.sh "$OUT"
# Each tree runs its own bench/cards.py (the engine's module names may differ between the two). Rows go to
# OUT/before_after.jsonl with a `tree` field (before / after); OUT/session.log has the runs' output. CASES
# picks the cases (default: klein 9B on the whole GPU, then as a 16 GiB card with blocks swapped); CASE_S
# bounds each run (s, default 150).
set -u
if [ "${1:-}" = --pack ]; then
  ref=${2:?the commit to compare with}
  mkdir -p .carry
  git archive --format=tar --prefix=before/ "$ref" ugpum bench/cards.py bench/place_train.py bench/common.py \
    bench/__init__.py comfy_bridge.py demo_datasets | xz -T0 > .carry/before.tar.xz
  echo "$(git rev-parse "$ref") -> .carry/before.tar.xz ($(du -h .carry/before.tar.xz | cut -f1))"
  exit 0
fi
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
log=$out/session.log
step() { echo "=== $* ($(date +%T))" | tee -a "$log"; }
step "unpack ComfyUI, its requirements and the earlier tree"
. bench/device_env.sh
unpack_comfyui || exit 1
rm -rf /tmp/before && tar -C /tmp -xJf .carry/before.tar.xz || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee -a "$log"
k9=/tmp/k9.safetensors
[ -f $k9 ] || { step "klein 9B write"; timeout 150 python3 bench/place_train.py write --model flux2-klein-9b --path $k9 >> "$log" 2>&1; }
rows=$out/before_after.jsonl
run_case() {      # tree (before|after), label, then bench/cards.py arguments
  local tree=$1 label=$2; shift 2
  local root=$PWD
  [ "$tree" = before ] && root=/tmp/before
  step "$tree: $label"
  timeout "${CASE_S:-150}" python3 "$root/bench/cards.py" --label "$label" --rows "$out/$tree.jsonl" \
    --work "/tmp/ba_${tree}_$label" --dataset "$PWD/demo_datasets/loranne" "$@" >> "$log" 2>&1
  echo "rc=$? $tree $label" | tee -a "$log"
  tail -1 "$out/$tree.jsonl" 2>/dev/null | TREE=$tree python3 -c 'import json,os,sys
r = json.loads(sys.stdin.read() or "{}"); r["tree"] = os.environ["TREE"]
print(json.dumps(r))' | tee -a "$rows" | python3 -c 'import json,sys
r = json.loads(sys.stdin.read()); print({k: r.get(k) for k in ("tree", "label", "s_per_step", "peak_reserved_gib", "peak_gib", "forecast_gib", "forecast_s", "swapped_blocks", "validation_after")})' | tee -a "$log"
}
for case in ${CASES:-whole 16}; do
  cap=$([ "$case" = whole ] || echo "--card-gib $case")
  for tree in before after; do
    run_case $tree klein-$case --model-file $k9 $cap --recompute auto --steps 12 --choice planner
  done
done
step done
