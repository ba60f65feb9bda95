"""What every jaxseq command shares at the edge: a bad argument is one line on stderr, exit status 2."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from jaxseq.config import ConfigError


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but its errors are `error: ...` alone (no usage block), like every other jaxseq error."""

    def error(self, message: str):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def error(message: str, status: int) -> int:
    """Print `error: message` on stderr; returns the exit status."""
    print(f"error: {message}", file=sys.stderr)
    return status


def run(command: Callable[[], int]) -> int:
    """A command's body, with the one ending every command shares: a ConfigError becomes one
    `error: …` line and exit status 2."""
    try:
        return command()
    except ConfigError as e:
        return error(str(e), 2)
