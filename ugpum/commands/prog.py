"""How the user ran the command line, so that every hint names a command they can type: `ugpum` where
they typed it (a checkout's .venv launcher, scripts/setup.sh), else `python -m ugpum` (a ComfyUI install,
run from the pack's folder)."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable

from ..wording import for_cli

MODULE = "python -m ugpum"


def prog() -> str:
    """`ugpum` when this process is the launcher of that name, else `python -m ugpum`."""
    return "ugpum" if sys.argv and os.path.basename(sys.argv[0]) == "ugpum" else MODULE


def in_own_words(text: str) -> str:
    """`text` with each `python -m ugpum VERB` hint (the core's and the catalog's wording) as `prog()` says it."""
    return text if prog() == MODULE else text.replace(MODULE + " ", prog() + " ")


def printer(verb: str) -> Callable[[object], None]:
    """`print` for what the engine logs while `verb` runs: the settings it marks as the verb's flags
    (ugpum/wording.py), its hints as the user typed the command."""
    def say(text) -> None:
        print(in_own_words(for_cli(str(text), verb)))
    return say
