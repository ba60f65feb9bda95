"""The jaxseq commands as a user runs them: in the pytest process (`main(argv)`), or as `python -m` in a
new process where only a process gives what is tested (its entry point, a signal, several processes).

In the pytest process a command shares the worker's JAX runtime (its 8 simulated devices, its compiled
primitives) instead of paying a new process's start-up; it prints into strings, not a terminal.
"""

import contextlib
import dataclasses
import io
import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Finished:
    """A command's exit status and what it printed (named as in subprocess.CompletedProcess)."""

    returncode: int
    stdout: str
    stderr: str


def command(main, *argv: str, check: bool = True) -> Finished:
    """`main(argv)` in this process. argparse's errors exit from inside parse_args (SystemExit, as a
    process would); the signal handlers the training loop installs for its run are put back after it."""
    out, err = io.StringIO(), io.StringIO()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as e:
                code = e.code
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    done = Finished(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())
    if check:
        assert_succeeded(done)
    return done


def assert_succeeded(done) -> None:
    """A command that should have succeeded, or its exit status and the ends of its output."""
    if done.returncode != 0:
        raise AssertionError(f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")


def env() -> dict:
    """A new process's environment: this checkout's jaxseq, and the devices its --host-devices asks for
    (not the XLA_FLAGS conftest.py sets for the pytest process)."""
    e = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    e["PYTHONPATH"] = ROOT
    return e


def python_m(module: str, *argv: str, timeout: int = 240, check: bool = False) -> subprocess.CompletedProcess:
    """`python -m module argv` in a new process."""
    done = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, cwd=ROOT, env=env(),
                          timeout=timeout)
    if check:
        assert_succeeded(done)
    return done
