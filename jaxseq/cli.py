"""What every jaxseq command shares at the edge: a bad argument is one line on stderr, exit status 2."""

from __future__ import annotations

import argparse
import sys


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but its errors are `error: ...` alone (no usage block), like every other jaxseq error."""

    def error(self, message: str):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)
