"""`train --profile START:STOP`: a `jax.profiler` trace of steps START … STOP (numbered from 1, as the metrics log
numbers them) and a device-memory profile, both in the run directory.

- The trace goes to RUN_DIR/tensorboard/plugins/profile/<time>/ (XLA's `.xplane.pb`, which TensorBoard's profile
  plugin reads beside the run's scalars with `tensorboard --logdir RUN_DIR/tensorboard`, and `.trace.json.gz`, which
  ui.perfetto.dev opens). It starts just before step START is dispatched and stops once step STOP has finished on the
  device; each step's dispatch is a `StepTraceAnnotation("train", step_num=N)`, so the viewers cut the trace by step.
- The memory profile (pprof, `go tool pprof` or pprof's web UI) is RUN_DIR/profile/memory-step<STOP>.prof, taken
  while step STOP runs, where the state, the batch and the step's outputs are all held (the arrays the runtime
  tracks; the compiled step's temporaries are its `memory_analysis`, which the loop checks against the device).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import jax

from jaxseq.config import ConfigError
from jaxseq.training import goodput


@dataclass(frozen=True)
class Window:
    """Steps START … STOP, both traced."""

    start: int
    stop: int


def parse_window(text: str | None, steps: int) -> Window | None:
    """`START:STOP` (1 ≤ START ≤ STOP ≤ steps) as a Window; None for None; one-line ConfigErrors otherwise."""
    if text is None:
        return None
    start, sep, stop = text.partition(":")
    try:
        window = Window(int(start), int(stop)) if sep else None
    except ValueError:
        window = None
    if window is None or not 1 <= window.start <= window.stop:
        raise ConfigError(f"profile={text!r} is not START:STOP with 1 ≤ START ≤ STOP (the steps to trace, e.g. 3:5)")
    if window.stop > steps:
        raise ConfigError(f"profile={text!r} ends past the run's last step, {steps}")
    return window


class Profiler:
    """Starts and stops the trace around the window's steps as the loop dispatches them (`before`, `annotate`,
    `after`); `files` then names what it wrote. Its own work is the run's "profiling" time on `clock`; the wait for the
    window's last step is the steps'."""

    def __init__(self, window: Window | None, run_dir: str, clock: goodput.Clock):
        self.window, self.clock = window, clock
        self.trace_dir = os.path.join(run_dir, "tensorboard")
        process = f"-process{jax.process_index()}" if jax.process_count() > 1 else ""  # each process its devices'
        self.memory_path = (os.path.join(run_dir, "profile", f"memory-step{window.stop}{process}.prof") if window
                            else None)
        self.tracing = False
        self.files: list[str] = []

    def in_window(self, step: int) -> bool:
        return self.window is not None and self.window.start <= step <= self.window.stop

    def before(self, step: int) -> None:
        """Called before step `step` is dispatched: the trace starts at the window's first."""
        if self.window is not None and step == self.window.start:
            with self.clock.part("profiling"):
                jax.profiler.start_trace(self.trace_dir)
            self.tracing = True

    def annotate(self, step: int):
        """The context step `step` is dispatched in: its StepTraceAnnotation in the window."""
        if not self.in_window(step):
            return contextlib.nullcontext()
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def after(self, step: int, out) -> None:
        """Called once step `step` is dispatched (`out`: its outputs): at the window's last, the memory profile while
        it runs, then the trace stopped once it has finished."""
        if not (self.tracing and step == self.window.stop):
            return
        with self.clock.part("profiling"):
            os.makedirs(os.path.dirname(self.memory_path), exist_ok=True)
            jax.profiler.save_device_memory_profile(self.memory_path)
        jax.block_until_ready(out)
        self.stop()

    def stop(self) -> None:
        """The trace stopped (a run that ends before the window's last step too), and its files found."""
        if not self.tracing:
            return
        with self.clock.part("profiling"):
            jax.profiler.stop_trace()
        self.tracing = False
        traces = os.path.join(self.trace_dir, "plugins", "profile")
        newest = max((os.path.join(traces, d) for d in os.listdir(traces)), key=os.path.getmtime)  # this trace's
        self.files = sorted(os.path.join(newest, name) for name in os.listdir(newest))
        self.files += [self.memory_path] if os.path.exists(self.memory_path) else []

    def line(self) -> str | None:
        """The closing report's line naming the files, or None without a window."""
        if self.window is None:
            return None
        if not self.files:
            return f"profile: steps {self.window.start}–{self.window.stop} did not run: no trace written"
        return (f"profile of steps {self.window.start}–{self.window.stop}: " + ", ".join(self.files)
                + f" (tensorboard --logdir {self.trace_dir}, or the .trace.json.gz in ui.perfetto.dev; the memory "
                "profile in pprof)")
