"""`python -m jaxseq.train` in the layouts `plan --search` can recommend with a pipeline: every schedule × context
strategy × optimizer state × family, in pairwise coverage. Each layout trains with an evaluation and a checkpoint at
each step, or resumes a checkpoint of its train state's shardings; its losses and validation losses are one
device's.

The numerics underneath are tested function by function (test_pipeline.py, test_context.py, test_fsdp.py, …); this
file is the command around them, which compiles the evaluation's forward-only pipeline, the checkpoint's shardings
and the resume's restore in each layout, where a crash once hid (the ring's evaluation under a pipeline).

A checkpoint holds the train state in its shardings, which the mesh, the optimizer state and the family fix
(`state_key`); the schedule, its virtual stages and the context strategy are no part of them (`Layout`'s specs and
`train_step.state_shardings` read none of the three). So the layouts with the same state's shardings share one
fresh run: the first of them in `LAYOUTS` trains steps 1 and 2 from the initialisation, and each of the others
resumes that run's checkpoint of step 1 and trains step 2 in its own layout. A layout whose shardings no other
layout has trains step 1, then resumes its own checkpoint for step 2: a second launch, which compiles the first
launch's programs again (the train command keeps a pipeline's from the tests' persistent cache,
`aot.uncached_if_pipelined`, from which, loaded, they deadlocked here in CI)."""

import itertools
import json
import os
import shutil
from collections import defaultdict

import pytest

from commands import command, python_m
from jaxseq import train as train_command

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
CONTEXTS = ("none", "all-gather", "ring")
STATES = ("plain", "distributed-optimizer", "fsdp")
FAMILIES = ("tiny", "tiny-llama")

# Pairwise: every two factors' levels meet in some row (`test_the_rows_cover_every_pair`). zb-h1 with fsdp is refused
# (config.validate_zero_bubble), so zb-h1's rows take the other two states. Chosen so that the states' shardings
# repeat (`state_key`): each context=2 row's are another context=2 row's, so that no ring layout launches twice; the
# four tensor + SP rows need all three states, so two of them have shardings of their own and launch twice.
LAYOUTS = [
    ("gpipe", "none", "plain", "tiny"),
    ("gpipe", "all-gather", "distributed-optimizer", "tiny"),
    ("gpipe", "ring", "fsdp", "tiny-llama"),
    ("1f1b", "none", "fsdp", "tiny"),
    ("1f1b", "all-gather", "plain", "tiny-llama"),
    ("1f1b", "ring", "distributed-optimizer", "tiny"),
    ("interleaved", "none", "plain", "tiny"),
    ("interleaved", "all-gather", "fsdp", "tiny-llama"),
    ("interleaved", "ring", "distributed-optimizer", "tiny"),
    ("zb-h1", "none", "distributed-optimizer", "tiny-llama"),
    ("zb-h1", "all-gather", "distributed-optimizer", "tiny"),
    ("zb-h1", "ring", "plain", "tiny-llama"),
]

# float32, 4 layers (2 stages × 2 chunks under interleaving), 4 micro-batches of 2 rows, no dropout (the pipelines'
# dropout masks against accumulation's: test_pipeline.py, test_context.py; here it only lengthened the ring's compile).
BASE = ["--dtype", "float32", "dropout=0.0", "--batch-size", "8", "--micro-batch-size", "2", "layers=4",
        "decay_steps=10", "--warmup-steps", "0", "--log-every", "1", "--eval-every", "1", "eval_batches=1",
        "--checkpoint-every", "1", "sample_tokens=0"]


def layout_args(schedule: str, context: str, state: str) -> list[str]:
    """The command's flags for one layout on 8 devices: pipe=2 × 2 ranks of the state's axis × (context=2, or
    tensor=2 with sequence parallelism). The virtual stages always given: a resume keeps a saved value not given."""
    axis = "fsdp" if state == "fsdp" else "data"
    inner = "tensor=2" if context == "none" else "context=2"
    args = ["--mesh", f"pipe=2,{axis}=2,{inner}"]
    args += ["--sequence-parallel"] if context == "none" else ["--context-strategy", context]
    if schedule == "interleaved":
        args += ["--schedule", "1f1b", "--virtual-stages", "2"]
    else:
        args += ["--schedule", schedule, "--virtual-stages", "1"]
    return args + (["--distributed-optimizer"] if state == "distributed-optimizer" else [])


def state_key(row) -> tuple[str, str, str]:
    """What a row's train state's shardings (and so its checkpoint's) depend on: the axis inside pipe × the state's
    axis (tensor with SP, or context), the optimizer state, the family."""
    schedule, context, state, family = row
    return ("tensor" if context == "none" else "context", state, family)


SHARING = defaultdict(list)  # state_key → its rows, in LAYOUTS' order: the first trains from the initialisation
for _row in LAYOUTS:
    SHARING[state_key(_row)].append(_row)


def records(run_dir: str) -> dict[int, dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if "run" not in r}  # not the closing time record


def launch(row, run_dir: str, *argv: str):
    """The train command in a row's layout, in this process; it compiled a pipelined step and evaluation."""
    schedule, context, state, family = row
    done = command(train_command.main, "--preset", family, *BASE, "--host-devices", "8",
                   *layout_args(schedule, context, state), "--run-dir", run_dir, *argv)
    assert "pipe=2" in done.stdout and "compiled the train step, the evaluation" in done.stdout
    return done


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


@pytest.fixture(scope="module")
def first_steps(tmp_path_factory):
    """row → the run directory of its launch from the initialisation, checkpointed at each step: steps 1 and 2 where
    another row resumes it, step 1 where the row resumes it itself."""
    done = {}

    def get(row) -> str:
        if row not in done:
            run_dir = str(tmp_path_factory.mktemp("-".join(row)))
            launch(row, run_dir, "--steps", "2" if len(SHARING[state_key(row)]) > 1 else "1")
            done[row] = run_dir
        return done[row]

    return get


def checked(got: dict[int, dict], want: dict[int, dict], steps: tuple[int, ...]) -> None:
    assert sorted(got) == list(steps), sorted(got)
    for step in steps:
        for key in ("loss", "val_loss"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-5), (step, key)


# Slow: 10–40 s each on 2 cores (a pipelined step and evaluation compiled, twice for the rows whose state's shardings
# are their own); the fast tier holds the ring's evaluation under a pipeline in test_context.py.
@pytest.mark.slow
@pytest.mark.parametrize("schedule,context,state,family", LAYOUTS, ids=["-".join(row) for row in LAYOUTS])
def test_a_layout_trains_evaluates_and_resumes_with_one_devices_losses(schedule, context, state, family, one_device,
                                                                      first_steps, tmp_path):
    """From the initialisation (the first row of its state's shardings) steps 1 and 2; resumed from a checkpoint of
    step 1 saved in its state's shardings (by the first such row, or by itself) step 2 in its own layout, which
    config.json records: each step's loss and validation loss are one device's."""
    row, want = (schedule, context, state, family), one_device(family)
    sharing = SHARING[state_key(row)]
    if row == sharing[0]:
        checked(records(first_steps(row)), want, (1, 2) if len(sharing) > 1 else (1,))
    if row == sharing[0] and len(sharing) > 1:
        return  # resumed by the others in `sharing`
    source, resumed = first_steps(sharing[0]), str(tmp_path / "resumed")
    os.makedirs(os.path.join(resumed, "checkpoints"))
    shutil.copy(os.path.join(source, "config.json"), resumed)
    shutil.copytree(os.path.join(source, "checkpoints", "1"), os.path.join(resumed, "checkpoints", "1"))
    launch(row, resumed, "--steps", "2", "--resume")
    saved = json.load(open(os.path.join(resumed, "config.json")))["parallel"]
    assert (saved["schedule"], saved["virtual_stages"]) == (("1f1b", 2) if schedule == "interleaved" else (schedule, 1))
    if context != "none":
        assert saved["context_strategy"] == context
    checked(records(resumed), want, (2,))


def test_the_rows_cover_every_pair():
    """Pairwise coverage of the four factors, zb-h1 × fsdp (refused) excepted."""
    factors = (SCHEDULES, CONTEXTS, STATES, FAMILIES)
    for i, j in itertools.combinations(range(4), 2):
        wanted = {(a, b) for a in factors[i] for b in factors[j]} - {("zb-h1", "fsdp")}
        assert wanted <= {(row[i], row[j]) for row in LAYOUTS}, (i, j)
