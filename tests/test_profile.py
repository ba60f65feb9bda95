"""`train --profile START:STOP` (training/profile.py) and where a run's time goes (training/goodput.py), on one short
run of the tiny preset: the trace `jax.profiler`'s reader opens holds steps 3–5 and no others, the memory profile is
written, the closing report names both; the time in set-up, compile, steps, evaluation, checkpointing and sampling
adds up to the run's wall time within a second, in the closing report and metrics.jsonl; bad ranges are one line."""

import json
import os
import time

import jax
import pytest

from commands import command
from jaxseq import train as train_command
from jaxseq.training.goodput import PARTS
from test_train import TINY

STEPS = 6


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """(the run directory, the command's output, its wall time in s) of 6 steps with --profile 3:5, checkpointed and
    evaluated every 3 steps, with a closing sample."""
    run_dir = str(tmp_path_factory.mktemp("profiled") / "run")
    start = time.perf_counter()
    done = command(train_command.main, *TINY, "--steps", str(STEPS), "--profile", "3:5", "--checkpoint-every", "3",
                   "--eval-every", "3", "--run-dir", run_dir)
    return run_dir, done.stdout, time.perf_counter() - start


def traced_steps(path: str) -> list[int]:
    """The step numbers of the `StepTraceAnnotation("train", …)` events in an .xplane.pb."""
    data = jax.profiler.ProfileData.from_file(path)
    return sorted(int(dict(event.stats)["step_num"]) for plane in data.planes for line in plane.lines
                  for event in line.events if event.name == "train")


@pytest.mark.slow  # one 6-step run of the tiny preset, which the next test reads too
def test_the_trace_holds_the_profiled_steps_and_no_others(profiled):
    run_dir, out, _ = profiled
    line = next(line for line in out.splitlines() if line.startswith("profile of steps 3–5: "))
    files = line.removeprefix("profile of steps 3–5: ").split(" (")[0].split(", ")
    xplane = [f for f in files if f.endswith(".xplane.pb")]
    assert len(xplane) == 1 and xplane[0].startswith(os.path.join(run_dir, "tensorboard", "plugins", "profile"))
    assert traced_steps(xplane[0]) == [3, 4, 5]
    assert any(f.endswith(".trace.json.gz") for f in files)  # Perfetto's
    memory = os.path.join(run_dir, "profile", "memory-step5.prof")
    assert memory in files and os.path.getsize(memory) > 0


@pytest.mark.slow
def test_the_parts_of_the_time_add_up_to_the_wall_time(profiled):
    """The closing `time:` line and metrics.jsonl's last record, `"run": "time"`: every part of the run measured as it
    ran adds up to the command's wall time (measured here, around it) within a second; goodput is the steps' share."""
    run_dir, out, wall = profiled
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    time_record = records[-1]
    assert time_record["run"] == "time" and time_record["step"] == STEPS and time_record["steps_run"] == STEPS
    assert all("run" not in r for r in records[:-1]) and len(records) == STEPS + 1
    parts = [time_record[f"{name}_s"] for name in PARTS]
    assert all(seconds > 0 for seconds in parts), time_record
    assert abs(sum(parts) - wall) < 1.0, (sum(parts), wall, time_record)
    assert time_record["goodput"] == pytest.approx(time_record["steps_s"] / time_record["wall_s"])
    assert time_record["mfu_steps"] is None  # CPU: no known peak
    line = next(line for line in out.splitlines() if line.startswith("time: "))
    assert f"goodput {100 * time_record['goodput']:.1f}% (time in {STEPS} steps / wall time)" in line


@pytest.mark.parametrize("window,message", [
    ("5:3", "error: profile='5:3' is not START:STOP with 1 ≤ START ≤ STOP (the steps to trace, e.g. 3:5)"),
    ("0:2", "error: profile='0:2' is not START:STOP"),
    ("3", "error: profile='3' is not START:STOP"),
    ("a:b", "error: profile='a:b' is not START:STOP"),
    ("3:99", "error: profile='3:99' ends past the run's last step, 6"),
])
def test_bad_ranges_are_one_line(window, message, tmp_path):
    done = command(train_command.main, *TINY, "--steps", str(STEPS), "--profile", window, "--run-dir",
                   str(tmp_path / "run"), check=False)
    assert done.returncode == 2 and done.stderr.startswith(message) and done.stderr.count("\n") == 1, done.stderr
