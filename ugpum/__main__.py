import sys

from .startup import hold_stops

hold_stops(command_line=True)           # (held since the package's import: the verbs' imports stop in one sentence)
from .commands import main  # noqa: E402

sys.exit(main())
