import sys

from .startup import stops_while_starting

with stops_while_starting(command_line=True):      # the verbs' imports: a stop is one sentence
    from .commands import main

sys.exit(main())
