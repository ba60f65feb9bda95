"""Progress lines on stderr while `plan` and `plan --search` compile (minutes for a paper model): which program,
n of N, seconds so far. stdout (the table, `--json`) is untouched."""

from __future__ import annotations

import sys
import threading
import time


class Progress:
    """`compiling(what)` prints `PREFIX: compiling n/N: what (s)`; N is what `expect` announced (it grows if more
    programs are compiled than announced). Thread-safe: the compiler builds two programs at a time."""

    def __init__(self, prefix: str, stream=None):
        self.prefix, self.stream = prefix, stream
        self.total = self.done = 0
        self._lock = threading.Lock()
        self._start = time.monotonic()

    def expect(self, n: int) -> None:
        with self._lock:
            self.total += n

    def compiling(self, what: str) -> None:
        with self._lock:
            self.done += 1
            self.total = max(self.total, self.done)
            self._print(f"compiling {self.done}/{self.total}: {what}")

    def note(self, text: str) -> None:
        with self._lock:
            self._print(text)

    def _print(self, text: str) -> None:
        print(f"{self.prefix}: {text} ({time.monotonic() - self._start:.0f} s)", file=self.stream or sys.stderr,
              flush=True)
