"""What a verb raises for a bad command line: printed as one sentence, exit code 2."""


class UsageError(ValueError):
    pass
