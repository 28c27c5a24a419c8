# Sourced by the device sessions (bench/*_session.sh, bench/before_after.sh, bench/comfyui_gpu.sh): the
# ComfyUI and the Python packages that bench/pack_device.sh packed, unpacked once per machine, and the
# environment that points the pack at them. Needs the carry [".carry/comfyui.tar.xz", ".whl"].
unpack_comfyui() {
  [ -f .carry/comfyui/main.py ] || tar -C .carry -xJf .carry/comfyui.tar.xz || return 1
  if [ ! -f /tmp/site/.done ]; then
    mkdir -p /tmp/site && xz -dc -T0 .whl/site.tar.xz | tar -C /tmp/site -x && touch /tmp/site/.done || return 1
  fi
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  export COMFYUI_PATH=$PWD/.carry/comfyui
}
