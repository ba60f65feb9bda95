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


def env(cache: bool = False) -> dict:
    """A new process's environment: this checkout's jaxseq, and the devices its --host-devices asks for (the
    XLA_FLAGS conftest.py sets for the pytest process without its device count: LLVM at -O0 stays, as it says).

    `cache`: the pytest processes' compilation cache too (conftest.py), for commands whose start-up is not what
    is tested (a command interrupted while it compiles would find its programs already built): a process then
    loads what the pytest process or an earlier command compiled with the same XLA flags (the device count
    is no part of the cache key), and several processes of one test (the two of a pair, the pair started
    again) compile each program once."""
    e = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    if flags:
        e["XLA_FLAGS"] = " ".join(flags)
    e["PYTHONPATH"] = ROOT
    if cache and os.environ.get("JAXSEQ_TESTS_COMPILATION_CACHE"):
        e["JAX_COMPILATION_CACHE_DIR"] = os.environ["JAXSEQ_TESTS_COMPILATION_CACHE"]
        e["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(2**33)  # as conftest.py: JAX then locks the directory
        e["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.25"  # as conftest.py: the programs under 1 s too
    return e


def python_m(module: str, *argv: str, timeout: int = 240, check: bool = False,
             cache: bool = False) -> subprocess.CompletedProcess:
    """`python -m module argv` in a new process (`cache`: as `env`)."""
    done = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, cwd=ROOT,
                          env=env(cache), timeout=timeout)
    if check:
        assert_succeeded(done)
    return done
