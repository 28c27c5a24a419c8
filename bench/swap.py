"""Block swap on one GPU (issue 5): unconstrained vs capped to play a smaller card, with swap.

  COMFYUI_PATH=/path/to/ComfyUI python bench/swap.py --model flux2-klein-9b --cap-gib 16 --steps 6 --out bench/results
  COMFYUI_PATH=/path/to/ComfyUI python bench/swap.py --model wan2.1-14b --cap-gib 16 --steps 6 --out bench/results

Writes a random-weight checkpoint first when --ckpt does not exist (deleted afterwards unless
--keep-ckpt). The same as `python -m ugpum bench swap`; see ugpum/bench_cli.py for what is measured.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ugpum.bench_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
