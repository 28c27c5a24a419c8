"""`python -m ugpum VERB`: one module per verb. The verbs are the only part of `ugpum` that builds
ComfyUI's models (through `comfy_bridge`, see `bridge.py`); the engine takes them from its caller."""
from __future__ import annotations

import argparse
import os
import signal
import sys

from ..startup import started
from ..train.stopping import Stop, stop_on_sigterm
from ..wording import EngineError, for_cli
from .bench import add_bench_parser, run_bench
from .demo import add_demo_parser, run_demo
from .doctor import add_doctor_parser, run_doctor
from .download import add_download_parser, run_download
from .errors import UsageError
from .output import guarded
from .plan import add_plan_parser, run_plan
from .prog import in_own_words, prog
from .train import add_train_parser, run_train

COMMANDS = {"plan": (add_plan_parser, run_plan), "train": (add_train_parser, run_train),
            "demo": (add_demo_parser, run_demo), "download": (add_download_parser, run_download),
            "doctor": (add_doctor_parser, run_doctor), "bench": (add_bench_parser, run_bench)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog(), description="UGPUM: LoRA training split over GPUs")
    sub = parser.add_subparsers(dest="command", required=True)
    for add, _ in COMMANDS.values():
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Block swap moves blocks of many sizes through a GPU every step; with the caching allocator's
    # default segments, fragments left Wan 14B fp8 on a 16 GiB card 2.5 GiB short
    # (bench/results/cards.json). Read when CUDA first allocates, so setting it here is in time.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    argv = sys.argv[1:] if argv is None else list(argv)
    with guarded(argv) as output:                        # long values cut; output that cannot be written
        try:
            code = _run(argv, output)
        except KeyboardInterrupt:                        # (argparse's help met a closed pipe)
            if not output.lost:
                raise
            code = 0
    return output.exit_code(code)


def _run(argv: list[str], output) -> int:
    args = build_parser().parse_args(argv)
    try:
        with stop_on_sigterm():                          # SIGTERM stops every verb as Ctrl-C does, with a word
            started()                                    # (the start-up's stops end here: ugpum/startup.py)
            return COMMANDS[args.command][1](args)
    except KeyboardInterrupt as why:                    # Ctrl-C, or SIGTERM (ugpum.train.stopping)
        signum = Stop.of(why).signum
        if output.lost:                                  # (the stop the lost output asked for: said by main)
            return 0
        print(f"\nstopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    except (EngineError, UsageError, ValueError, RuntimeError, OSError) as e:   # (the engine's, marked: as flags)
        if os.environ.get("UGPUM_DEBUG"):
            raise
        print(f"error: {in_own_words(for_cli(said(e), args.command))}", file=sys.stderr)
        return 2


def said(error: BaseException) -> str:
    """An error as the sentence to print: the engine's own, or the system's reason in words and the file
    it concerns (never "[Errno 36] ...")."""
    if isinstance(error, OSError) and not isinstance(error, EngineError) and error.strerror:
        files = " and ".join(str(f) for f in (error.filename, error.filename2) if f is not None)
        return f"cannot use {files or 'a file'}: {error.strerror.lower()}; check the path given"
    return str(error)
