"""What every jaxseq command shares at the edge: a bad argument is one line on stderr, exit status 2."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import threading
from typing import Callable

from jaxseq.config import ConfigError


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but its errors are `error: ...` alone (no usage block), like every other jaxseq error, and a
    negative number in any notation (`--lr -1e-3`, `-.5`, `-inf`) is a value: argparse's own pattern
    (`-1`, `-0.5`) took `-1e-3` for an option ("expected one argument"). No jaxseq option looks like a number."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$", re.IGNORECASE)

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


SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived where nothing can be saved (a command's start-up): the command ends."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def status(self) -> int:
        """The shell's convention for a process a signal ended: 128 + its number (130, 143)."""
        return 128 + self.signum


@contextlib.contextmanager
def interruptible():
    """While the block runs, SIGINT and SIGTERM raise `Interrupted` (in the main thread; elsewhere Python
    has no handlers to set), and the handlers before are put back after it. The training loop installs its
    own for the steps (`loop.StopFlag`: save, then stop)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, interrupt) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def exit_process(status: int) -> None:
    """A command process's end. After a signal (status 128 + N) the interpreter is not torn down (the output
    flushed, then `os._exit`): XLA's compiler threads may still run, and the teardown crashed under them
    (a segmentation fault, exit 139, after Ctrl-C during compilation)."""
    if status > 128:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
