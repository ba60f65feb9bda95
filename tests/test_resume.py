"""Resume in every layout family the search recommends: save, stop, restore, and the losses after the resume equal
an uninterrupted run's (float32, relative ≤ 1e-5).

The families: data × tensor + SP; pipe × data × tensor under 1F1B and interleaved; data × context × tensor under
both context strategies (all-gather, ring); context (all-gather) inside a pipeline. Each family's state shardings
with and without the distributed optimizer and, where there is no pipeline (a pipeline always accumulates), with
one micro-batch and with two: pairwise, not every product, and the ring's and interleaving's shardings, which are
all-gather's and 1F1B's, by those families' rows (`MATRIX`). The distributed optimizer's master shards split one
dimension over several mesh axes at once there (("data", "context") under context parallelism, ("pipe", "data") for
the embedding group under a pipeline): the restore read each such entry as one axis name (a KeyError) until
`parallel.layout.restorable` (then in checkpoint.py) took the product of the axes' sizes.

Each row's step is compiled once and runs both the uninterrupted run (which saves at step SAVED_AT) and the
resumed one; the resumes onto another mesh (`MOVES`) reuse the rows' programs. In-process ("stop after SAVED_AT
steps" is the checkpoint of the uninterrupted run); `test_a_killed_run_resumes_with_the_losses_of_an_uninterrupted_one`
is the one subprocess: `python -m jaxseq.train` SIGKILLed, then `--resume`.
"""

import os
import signal
import subprocess
import sys
import time
from functools import lru_cache

import jax
import pytest

from jaxseq.config import OptimizerConfig, ParallelConfig, replace
from jaxseq.presets import preset
from jaxseq.models import model as M
from jaxseq.training import train_step as T

from compiled_steps import CompiledStep

# 4 layers (pipe × virtual stages = 2 × 2 divides them), dropout on (the tiny preset's 0.1): every row draws the
# same global masks, so rows with the same micro-batches compute the same losses on any mesh.
CFG = replace(preset("tiny"), layers=4, dtype="float32")
OPT = T.make_optimizer(OptimizerConfig(lr=3e-3, warmup_steps=1, decay_steps=10), CFG)
BATCH, STEPS, SAVED_AT = 8, 4, 2
KEY = jax.random.key(1)
REL = 1e-5

# family → ParallelConfig on 8 devices (the distributed optimizer is the matrix's to set)
LAYOUTS = {
    "data4-tensor2-sp": ParallelConfig(data=4, tensor=2, sequence_parallel=True),
    "1f1b-pipe2-data2-tensor2-sp": ParallelConfig(pipe=2, data=2, tensor=2, sequence_parallel=True, schedule="1f1b"),
    "interleaved-pipe2v2-data2-tensor2-sp": ParallelConfig(pipe=2, data=2, tensor=2, sequence_parallel=True,
                                                           schedule="interleaved", virtual_stages=2),
    "all-gather-data2-context2-tensor2-sp": ParallelConfig(data=2, context=2, tensor=2, sequence_parallel=True),
    "ring-data2-context2-tensor2-sp": ParallelConfig(data=2, context=2, tensor=2, sequence_parallel=True,
                                                     context_strategy="ring"),
    "all-gather-pipe2-context2-tensor2": ParallelConfig(pipe=2, context=2, tensor=2),
}

# (family, distributed optimizer, micro-batches): each unpipelined family with the optimizer on and off and with 1
# and 2 micro-batches, each (optimizer, micro-batches) pair; every pipelined family's shardings with the optimizer on
# (its master shards join `pipe` and `data` or `context` on one dimension), and one without it (a pipeline's plain
# specs, which the resumes in test_pipeline_train.py restore onto too). A row is a compile (5–20 s on 2 cores).
# The schedule, its virtual stages and the context strategy are no part of a state's shardings (`Layout`'s specs
# and `T.state_shardings` read none of them), so a family that differs from another by one of them alone resumes
# its step once: the ring's (the all-gather rows restore the same shardings with the optimizer on and off, and at 1
# and 2 micro-batches), and interleaving's (1F1B's row restores its shardings with the optimizer on).
MATRIX = [
    ("data4-tensor2-sp", True, 1),
    ("data4-tensor2-sp", False, 2),
    ("all-gather-data2-context2-tensor2-sp", True, 2),
    ("all-gather-data2-context2-tensor2-sp", False, 1),
    ("ring-data2-context2-tensor2-sp", False, 2),
    ("1f1b-pipe2-data2-tensor2-sp", True, 2),
    ("interleaved-pipe2v2-data2-tensor2-sp", False, 2),
    ("all-gather-pipe2-context2-tensor2", True, 2),
]


def _id(row) -> str:
    family, distributed, m = row
    return f"{family}{'-distopt' if distributed else ''}-m{m}"


@lru_cache(maxsize=None)
def row(family: str, distributed: bool, micro_batches: int) -> CompiledStep:
    """A row's mesh, state shardings and compiled step."""
    parallel = replace(LAYOUTS[family], distributed_optimizer=distributed)
    return CompiledStep(CFG, parallel, OPT, micro_batches, BATCH, KEY, SAVED_AT)


@lru_cache(maxsize=None)
def initial_state():
    """Step 0 on the host, the same for every row (each row places it in its shards: no compile per row)."""
    return jax.device_get(jax.jit(lambda key: T.new_state(M.init_params(key, CFG, 2), OPT))(jax.random.key(0)))


def uninterrupted(r, directory: str) -> list[float]:
    """STEPS steps from the initial state, checkpointed at step SAVED_AT into `directory`."""
    assert LAYOUTS[r[0]].tensor == 2  # the vocabulary padding of initial_state
    return row(*r).run(jax.device_put(initial_state(), row(*r).shardings), 0, STEPS, save_to=directory)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """row → (losses of STEPS uninterrupted steps, the directory of its checkpoint at step SAVED_AT)."""
    cache = {}

    def get(r):
        if r not in cache:
            directory = str(tmp_path_factory.mktemp("resume"))
            cache[r] = (uninterrupted(r, directory), directory)
        return cache[r]

    return get


def _close(got: list[float], want: list[float]):
    assert len(got) == len(want)
    for x, y in zip(got, want):
        assert abs(x - y) <= REL * abs(y), (got, want)


# The fast tier resumes one row whose master shards split over data × context.
FAST = ("all-gather-data2-context2-tensor2-sp", True, 2)


@pytest.mark.parametrize("r", [pytest.param(r, marks=[] if r == FAST else pytest.mark.slow) for r in MATRIX], ids=_id)
def test_resume_gives_the_uninterrupted_losses(saved, r):
    losses, directory = saved(r)
    assert losses[-1] < losses[0]  # it learns
    _close(row(*r).run(row(*r).restore(directory), SAVED_AT, STEPS), losses[SAVED_AT:])


# (saved by, resumed by): context=2 → data, pipe=2 → pipe=1, the distributed optimizer on → off; and onto the
# master shards split over several axes (data → context, pipe=1 → pipe=2 with the optimizer on, pipe=2 → 1 with
# context). Rows with the same
# micro-batches compute the same losses (the same global dropout masks on any mesh).
MOVES = [
    (("all-gather-data2-context2-tensor2-sp", True, 2), ("data4-tensor2-sp", False, 2)),
    (("1f1b-pipe2-data2-tensor2-sp", True, 2), ("data4-tensor2-sp", False, 2)),
    (("data4-tensor2-sp", False, 2), ("ring-data2-context2-tensor2-sp", False, 2)),
    (("data4-tensor2-sp", False, 2), ("1f1b-pipe2-data2-tensor2-sp", True, 2)),
    (("all-gather-pipe2-context2-tensor2", True, 2), ("all-gather-data2-context2-tensor2-sp", True, 2)),
]


@pytest.mark.slow
@pytest.mark.parametrize("source,target", MOVES, ids=lambda r: _id(r))
def test_resume_onto_another_mesh(saved, source, target):
    losses, directory = saved(source)
    _close(row(*target).run(row(*target).restore(directory), SAVED_AT, STEPS), losses[SAVED_AT:])


@pytest.mark.slow
def test_a_killed_run_resumes_with_the_losses_of_an_uninterrupted_one(tmp_path):
    """`python -m jaxseq.train` on data=2 × context=2 × tensor=2 with the distributed optimizer (master shards over
    data × context), SIGKILLed two steps after a checkpoint (an asynchronous save may be cut short: its temporary
    directory is left behind); `--resume` continues from the newest complete checkpoint with the losses the run
    logged for the steps after it before it was killed, which were an uninterrupted run's (its learning-rate
    schedule fixed by warmup and decay steps, not by --steps). Should the kill have come after a later checkpoint
    completed, an uninterrupted run in this process is the reference. The killed process writes its programs to the
    tests' compilation cache (`commands.env`): the resume in this process loads them."""
    from commands import ROOT, env
    from test_train import losses, run

    args = ["--preset", "tiny", "--dtype", "float32", "--batch-size", "8", "--host-devices", "8",
            "--mesh", "data=2,context=2,tensor=2", "--distributed-optimizer", "--checkpoint-every", "4",
            "--log-every", "1", "--eval-every", "100000", "--warmup-steps", "2", "decay_steps=20", "eval_batches=1",
            "sample_tokens=0"]  # no end-of-run sample is read: none compiled
    killed = str(tmp_path / "killed")
    checkpoints = os.path.join(killed, "checkpoints")
    complete = lambda: [int(d) for d in os.listdir(checkpoints) if d.isdigit()] if os.path.isdir(checkpoints) else []

    def logged() -> int:
        try:
            return max(losses(killed), default=0)
        except (OSError, ValueError):  # not written yet, or a line being written
            return 0

    proc = subprocess.Popen([sys.executable, "-m", "jaxseq.train", *args, "--steps", "100000", "--run-dir", killed],
                            cwd=ROOT, env=env(cache=True), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None and not (complete() and logged() >= max(complete()) + 2):
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        err = proc.communicate(timeout=60)[1]
    assert proc.returncode == -signal.SIGKILL and complete(), err[-3000:]
    before, newest = losses(killed), max(complete())
    last = max(before)
    if last <= newest:  # a later checkpoint completed before the kill: the steps after it were never logged
        last = newest + 2
        run(*args, "--steps", str(last), "--run-dir", str(tmp_path / "straight"))
        before = losses(str(tmp_path / "straight"))
    run(*args, "--steps", str(last), "--run-dir", killed, "--resume")
    resumed = losses(killed)
    for step in range(newest + 1, last + 1):
        assert abs(resumed[step] - before[step]) <= REL * abs(before[step]), (step, newest, resumed, before)
