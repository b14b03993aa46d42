"""Errors the command line turns into one clear message and exit code 2."""


class UsageError(ValueError):
    """Bad input from the user: a file, a key, a name or a value that is not what was expected.

    The message names what is wrong and what was expected. The CLI prints it and exits with 2,
    before any model loads or any result is written.
    """


def print_warning(line: str) -> None:
    """One warning line on stderr, as every command prints them."""
    import sys

    print(f"nsa-eval: warning: {line}", file=sys.stderr)
