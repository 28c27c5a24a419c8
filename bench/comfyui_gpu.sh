#!/usr/bin/env bash
# The node pack in the newest ComfyUI's default GPU mode (issue 17 item 1), on the device machine (one H200).
#
# Here, first:  bash bench/pack_device.sh      (ComfyUI 0.33 + the wheels the image lacks; see its header)
# Then one device call, carry [".carry/comfyui.tar.xz", ".whl"]:
#   bash bench/comfyui_gpu.sh "$OUT" [tests] [klein] [cli]     (default: tests klein)
#
# ComfyUI runs as users run it on NVIDIA: no --cpu, DynamicVRAM (comfy-aimdo) and cudaMallocAsync as
# they come (UGPUM_TEST_COMFYUI_GPU=1 makes tests/support/comfy_server.py leave out --cpu).
#   tests  tests/test_comfy_nodes.py against that server (tiny models: Loader -> Planner -> Trainer ->
#          Sample Preview, cancel/resume, the workflows), while the full-size klein 9B files are written
#          in the background (bench/real_model_files.py -> /tmp/k9models)
#   klein  bench/comfyui_gpu_klein.py: klein 9B through the nodes and ComfyUI's own loaders and sampler,
#          GPU memory (NVML, ComfyUI's /system_stats) before, during and after our run
#   cli    bench/train_real_files.py: the same files through `python -m ugpum train --models`'s path
#          (issue 14): GPU memory per phase and s/step into train_real_files.json
# Writes into OUT: comfyui_gpu.log (all output), versions.txt, test_comfy_nodes.txt, write_models.log,
# klein9b_gpu.json, comfyui_klein9b.log. Copy them to bench/results/. TESTS_TIMEOUT and KLEIN_TIMEOUT (s)
# bound the two sections (defaults 280 and 400); KLEIN_ARGS passes options to comfyui_gpu_klein.py.
set -u
out=${1:?output folder}; shift
sections=${*:-tests klein}
mkdir -p "$out"
exec > >(tee -a "$out/comfyui_gpu.log") 2>&1
export PYTHONUNBUFFERED=1
step() { echo "=== $* ($(date +%T))"; }

step "unpack ComfyUI and its requirements"
. bench/device_env.sh
unpack_comfyui || exit 1
export UGPUM_TEST_COMFYUI_GPU=1
{
  echo "ComfyUI commit $(cat .carry/comfyui/COMMIT), $(grep __version__ .carry/comfyui/comfyui_version.py)"
  python3 - <<'EOF'
import importlib.metadata as m, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
for p in ("comfy-aimdo", "comfy-kitchen", "av", "transformers", "safetensors", "triton"):
    try:
        print(p, m.version(p))
    except m.PackageNotFoundError:
        print(p, "absent")
EOF
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
} | tee "$out/versions.txt"

writer=
for s in $sections; do
  case $s in
  tests)
    step "write full-size klein 9B files in the background"
    ( timeout 300 python3 bench/real_model_files.py /tmp/k9models > "$out/write_models.log" 2>&1 ) &
    writer=$!
    step "tests/test_comfy_nodes.py, ComfyUI in GPU mode"
    timeout ${TESTS_TIMEOUT:-280} python3 -m pytest -v -p no:cacheprovider -rfE tests/test_comfy_nodes.py > "$out/test_comfy_nodes.txt" 2>&1
    echo "pytest exit $?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/test_comfy_nodes.txt" | tail -60 ;;
  cli)
    if [ -n "$writer" ]; then step "waiting for the model files"; wait "$writer"; writer=; fi
    [ -f /tmp/k9models/vae/flux2-vae.safetensors ] || timeout 300 python3 bench/real_model_files.py /tmp/k9models > "$out/write_models.log" 2>&1
    step "klein 9B headless: python -m ugpum train --models (ComfyUI's own loaders), GPU memory per phase"
    timeout ${CLI_TIMEOUT:-300} python3 bench/train_real_files.py --models /tmp/k9models --steps ${CLI_STEPS:-6} \
      --out /tmp/cli_run --json "$out/train_real_files.json" > "$out/train_real_files.log" 2>&1
    echo "cli exit $?"; tail -5 "$out/train_real_files.log" ;;
  klein)
    if [ -n "$writer" ]; then step "waiting for the model files"; wait "$writer"; writer=; fi
    [ -f /tmp/k9models/vae/flux2-vae.safetensors ] || timeout 300 python3 bench/real_model_files.py /tmp/k9models > "$out/write_models.log" 2>&1
    cat "$out/write_models.log"
    step "klein 9B through the nodes, ComfyUI in GPU mode"
    timeout ${KLEIN_TIMEOUT:-400} python3 bench/comfyui_gpu_klein.py --models /tmp/k9models --out "$out" ${KLEIN_ARGS:-}
    echo "klein exit $?" ;;
  *) echo "unknown section $s" ;;
  esac
done
nvidia-smi --query-gpu=memory.used --format=csv
step "done"
