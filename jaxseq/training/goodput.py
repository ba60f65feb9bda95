"""Where a run's wall time went (the closing report's `time:` line and the last record of metrics.jsonl): set-up
(devices, data, configuration, restoring or initialising the state, the metrics log), compile, steps, evaluation,
checkpointing, sampling (the closing report: the data's unigram entropy and the sample) and profiling (`--profile`:
starting the trace, the memory profile, writing the trace), each timed as the loop runs it; the MFU of the steps; and
the run's goodput, the time in steps over the wall time.

Every second of the run is the innermost part running then (`Clock.part`: a part inside another, an evaluation inside
the step loop, pauses it), so the parts add up to the wall time less what runs outside every part (`other`: the
lines between them, well under a second). "steps" is the step loop's time outside evaluation and checkpointing: the
steps dispatched and finished (the host waits for a step at each log, checkpoint and evaluation boundary, so its time
is the device's), the batches read and the metric records written between them.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager

PARTS = ("set_up", "compile", "steps", "evaluation", "checkpointing", "sampling", "profiling")


class Clock:
    """The run's wall time from its start, split into PARTS."""

    def __init__(self):
        self.start = time.perf_counter()
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self._running: list[tuple[str, float]] = []  # (part, when it last resumed), innermost last

    @contextmanager
    def part(self, name: str):
        """Time the block as `name`, pausing the part it runs inside."""
        now = time.perf_counter()
        if self._running:
            outer, since = self._running[-1]
            self.seconds[outer] += now - since
        self._running.append((name, now))
        try:
            yield
        finally:
            name, since = self._running.pop()
            now = time.perf_counter()
            self.seconds[name] += now - since
            if self._running:
                self._running[-1] = (self._running[-1][0], now)

    def report(self, steps: int, mfu: float | None) -> dict:
        """The record: the wall time, each part's seconds and the rest's, the steps run, goodput and the steps' MFU
        (None without a known peak)."""
        wall = time.perf_counter() - self.start
        parts = {f"{name}_s": seconds for name, seconds in self.seconds.items()}
        return {"wall_s": wall, **parts, "other_s": wall - sum(self.seconds.values()), "steps_run": steps,
                "goodput": self.seconds["steps"] / wall if wall > 0 else 0.0, "mfu_steps": mfu}


def format_line(record: dict) -> str:
    """The closing report's line: seconds of wall time per part (and its share), goodput and the steps' MFU."""
    wall = record["wall_s"]
    parts = " + ".join(f"{name.replace('_', '-')} {record[f'{name}_s']:.1f} s ({100 * record[f'{name}_s'] / wall:.0f}%)"
                       for name in (*PARTS, "other"))
    mfu = ("MFU unknown (no peak: --peak-tflops)" if record["mfu_steps"] is None
           else f"MFU of the steps {100 * record['mfu_steps']:.1f}% (model FLOPs over their time and the peak)")
    return (f"time: {wall:.1f} s wall = {parts}; goodput {100 * record['goodput']:.1f}% (time in "
            f"{record['steps_run']} steps / wall time); {mfu}")


def write_record(run_dir: str, step: int, record: dict) -> None:
    """The record appended to RUN_DIR/metrics.jsonl after the last step's, told from the steps' records by its
    "run": "time" (the log's writer is closed by then; a resumed run appends its own after its steps)."""
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"run": "time", "step": step, **record}) + "\n")
