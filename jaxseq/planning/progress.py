"""Progress lines on stderr while `plan` and `plan --search` compile (minutes for a paper model): which program,
n of N, seconds so far. stdout (the table, `--json`) is untouched."""

from __future__ import annotations

import sys
import threading
import time


class Progress:
    """`compiling(what)` prints `PREFIX: compiling n/N: what (s)`, N the programs of the phase, every one announced
    (`expect`) before its first compiles, so that N does not change as the work goes. A later phase whose work
    depends on what the first found (`phase`) is named and counted from 1; one whose count is not known until it
    ends says so (`compiling n (total not known)`). A program beyond the announced total is printed as such
    (`n (N announced)`), not counted as if N had grown. Thread-safe: the compiler builds two programs at a time."""

    def __init__(self, prefix: str, stream=None):
        self.prefix, self.stream = prefix, stream
        self.total = self.done = 0
        self.known = True  # whether this phase's total was announced
        self._lock = threading.Lock()
        self._start = time.monotonic()

    def expect(self, n: int) -> None:
        """Announce n more programs of this phase, before any of them compiles."""
        with self._lock:
            self.total += n

    def phase(self, name: str, total: int | None) -> None:
        """Start phase `name`: `total` programs (None: not known until it ends), counted from 1."""
        with self._lock:
            self.done, self.total, self.known = 0, total or 0, total is not None
            self._print(f"{name}: " + (f"{total} program{'s' if total != 1 else ''}" if self.known
                                       else "how many programs is not known until it ends"))

    def compiling(self, what: str) -> None:
        with self._lock:
            self.done += 1
            if not self.known:
                count = f"{self.done} (total not known)"
            elif self.done > self.total:
                count = f"{self.done} ({self.total} announced)"
            else:
                count = f"{self.done}/{self.total}"
            self._print(f"compiling {count}: {what}")

    def note(self, text: str) -> None:
        with self._lock:
            self._print(text)

    def _print(self, text: str) -> None:
        print(f"{self.prefix}: {text} ({time.monotonic() - self._start:.0f} s)", file=self.stream or sys.stderr,
              flush=True)
