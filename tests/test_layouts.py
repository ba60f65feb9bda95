"""`python -m jaxseq.train` in the layouts `plan --search` can recommend with a pipeline: every schedule × context
strategy × optimizer state × family, in pairwise coverage. Each layout trains a step with an evaluation and a
checkpoint, is resumed for a second, and gives one device's losses and validation losses.

The numerics underneath are tested function by function (test_pipeline.py, test_context.py, test_fsdp.py, …); this
file is the command around them, which compiles the evaluation's forward-only pipeline, the checkpoint's shardings
and the resume's restore in each layout, where a crash once hid (the ring's evaluation under a pipeline). The resume
compiles the first launch's programs again: the train command keeps a pipeline's from the tests' persistent cache
(`aot.uncached_if_pipelined`), from which, loaded, they deadlocked here in CI."""

import itertools
import json
import os

import pytest

from commands import command, python_m
from jaxseq import train as train_command

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
CONTEXTS = ("none", "all-gather", "ring")
STATES = ("plain", "distributed-optimizer", "fsdp")
FAMILIES = ("tiny", "tiny-llama")

# Pairwise: every two factors' levels meet in some row (`test_the_rows_cover_every_pair`). zb-h1 with fsdp is refused
# (config.validate_zero_bubble), so zb-h1's rows take the other two states.
LAYOUTS = [
    ("gpipe", "none", "plain", "tiny"),
    ("gpipe", "all-gather", "distributed-optimizer", "tiny-llama"),
    ("gpipe", "ring", "fsdp", "tiny"),
    ("1f1b", "none", "distributed-optimizer", "tiny-llama"),
    ("1f1b", "all-gather", "fsdp", "tiny"),
    ("1f1b", "ring", "plain", "tiny-llama"),
    ("interleaved", "none", "fsdp", "tiny-llama"),
    ("interleaved", "all-gather", "plain", "tiny"),
    ("interleaved", "ring", "distributed-optimizer", "tiny"),
    ("zb-h1", "none", "plain", "tiny-llama"),
    ("zb-h1", "all-gather", "distributed-optimizer", "tiny"),
    ("zb-h1", "ring", "distributed-optimizer", "tiny-llama"),
]

# float32, 4 layers (2 stages × 2 chunks under interleaving), 4 micro-batches of 2 rows, no dropout (the pipelines'
# dropout masks against accumulation's: test_pipeline.py, test_context.py; here it only lengthened the ring's compile).
BASE = ["--dtype", "float32", "dropout=0.0", "--batch-size", "8", "--micro-batch-size", "2", "layers=4",
        "decay_steps=10", "--warmup-steps", "0", "--log-every", "1", "--eval-every", "1", "eval_batches=1",
        "--checkpoint-every", "1", "sample_tokens=0"]


def layout_args(schedule: str, context: str, state: str) -> list[str]:
    """The command's flags for one layout on 8 devices: pipe=2 × 2 ranks of the state's axis × (context=2, or
    tensor=2 with sequence parallelism)."""
    axis = "fsdp" if state == "fsdp" else "data"
    inner = "tensor=2" if context == "none" else "context=2"
    args = ["--mesh", f"pipe=2,{axis}=2,{inner}"]
    args += ["--sequence-parallel"] if context == "none" else ["--context-strategy", context]
    if schedule == "interleaved":
        args += ["--schedule", "1f1b", "--virtual-stages", "2"]
    else:
        args += ["--schedule", schedule]
    return args + (["--distributed-optimizer"] if state == "distributed-optimizer" else [])


def records(run_dir: str) -> dict[int, dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if "run" not in r}  # not the closing time record


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """family → its 2-step run on one device (a new process: the pytest process has 8), with the layouts' batches
    and micro-batches."""
    done = {}

    def get(family: str) -> dict[int, dict]:
        if family not in done:
            run_dir = str(tmp_path_factory.mktemp(f"one-device-{family}"))
            python_m("jaxseq.train", "--preset", family, *BASE, "--host-devices", "1", "--mesh", "data=1",
                     "--steps", "2", "--run-dir", run_dir, check=True)
            done[family] = records(run_dir)
        return done[family]

    return get


# Slow: 14–50 s each on 2 cores (the step and the evaluation compiled twice, for the run and its resume); the fast
# tier holds the ring's evaluation under a pipeline in test_context.py.
@pytest.mark.slow
@pytest.mark.parametrize("schedule,context,state,family", LAYOUTS, ids=["-".join(row) for row in LAYOUTS])
def test_a_layout_trains_evaluates_and_resumes_with_one_devices_losses(schedule, context, state, family, one_device,
                                                                      tmp_path):
    """Step 1 (evaluated, checkpointed), then the run resumed for step 2: both steps' losses and validation losses
    are one device's."""
    args = ["--preset", family, *BASE, "--host-devices", "8", *layout_args(schedule, context, state),
            "--run-dir", str(tmp_path)]
    first = command(train_command.main, *args, "--steps", "1")
    assert "pipe=2" in first.stdout and "compiled the train step, the evaluation" in first.stdout
    command(train_command.main, *args, "--steps", "2", "--resume")
    got, want = records(str(tmp_path)), one_device(family)
    for step in (1, 2):
        for key in ("loss", "val_loss"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-5), (step, key)


def test_the_rows_cover_every_pair():
    """Pairwise coverage of the four factors, zb-h1 × fsdp (refused) excepted."""
    factors = (SCHEDULES, CONTEXTS, STATES, FAMILIES)
    for i, j in itertools.combinations(range(4), 2):
        wanted = {(a, b) for a in factors[i] for b in factors[j]} - {("zb-h1", "fsdp")}
        assert wanted <= {(row[i], row[j]) for row in LAYOUTS}, (i, j)
