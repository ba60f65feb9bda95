"""Two local processes × 4 simulated CPU devices, through jax.distributed (gloo collectives)."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from commands import ROOT, env
from test_train import losses, run

ARGS = ["--preset", "tiny", "--dtype", "float32", "--batch-size", "8", "--mesh", "data=2,tensor=4",
        "--sequence-parallel", "--remat", "selective", "--log-every", "1", "--eval-every", "100",
        "--warmup-steps", "2", "decay_steps=10", "eval_batches=1", "sample_tokens=4"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A pair's heartbeat timeout, unless a test sets its own: CI's two cores, shared with the other worker's compiles, have
# starved both heartbeats past the 20-s default (both tasks "stopped sending heartbeats" before step 1).
HEARTBEAT = ["--heartbeat-timeout", "120"]


def failure(err: str) -> str:
    """A process's stderr for an assertion message: its start (the first error, which JAX's later fatal lines
    point back to) and its end."""
    return err if len(err) <= 6000 else f"{err[:3000]}\n[...]\n{err[-3000:]}"


# A run the test stops (a kill, a signal) never reaches its end-of-run sample: none is compiled.
UNFINISHED = ["--steps", "100000", "--checkpoint-every", "100000", "sample_tokens=0"]


def launch(run_dir, steps, extra=(), slurm=False, base=ARGS):
    """Two processes of the train command with `base`'s arguments, told their coordinates by flags or, with
    `slurm`, by the environment srun gives two tasks on one node (JAX's own SLURM detection then finds them). They
    share the tests' compilation cache (`commands.env`): a pair started with the same arguments as an earlier one
    loads its programs."""
    port = free_port()
    procs = []
    for i in range(2):
        argv = [sys.executable, "-m", "jaxseq.train", *base, "--host-devices", "4",
                *(["--steps", str(steps)] if steps is not None else []), "--run-dir", run_dir, *HEARTBEAT, *extra]
        e = env(cache=True)
        if slurm:
            e.update(SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
                     SLURM_PROCID=str(i), SLURM_LOCALID=str(i), JAX_COORDINATOR_PORT=str(port))
        else:
            argv += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)]
        procs.append(subprocess.Popen(argv, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    return procs


# Layouts whose processes share batch rows or weights: one pipeline stage per process (tensor and data inside a host,
# stages across hosts, the PTD-P layout), context ranks across processes, and FSDP ranks across processes (each
# layer's weights gathered from both hosts). Each process reads every row its devices hold (it used to stop with
# "not an even share"). Two micro-batches a step in every layout, so one single-process run is the reference of all
# (the losses do not depend on the mesh: float32, dropout masks of the global batch).
ACROSS_HOSTS = {"pipe": ["--mesh", "pipe=2,data=2,tensor=2"], "context": ["--mesh", "context=2,tensor=4"],
                "fsdp": ["--mesh", "fsdp=2,tensor=4"]}
MICRO = ["--micro-batch-size", "4", "sample_tokens=0"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """The losses of 1 process × 8 devices (data=2 × tensor=4 + SP, two micro-batches), 6 steps: the reference of
    every pair below (steps 1–3; a resumed pair's steps 5 and 6). The schedule ends at decay_steps=10 whatever the
    run's length, so the first 3 steps are a 3-step run's."""
    run_dir = str(tmp_path_factory.mktemp("single"))
    run(*ARGS, "--host-devices", "8", "--steps", "6", "--run-dir", run_dir, *MICRO)
    return losses(run_dir)


@pytest.mark.slow
def test_two_processes_match_one_and_their_checkpoint_restores_in_one(one_process, tmp_path):
    """The pair runs with the distributed optimizer (its state split over data across the two
    processes) and draws the end-of-run sample, the single process without either (`one_process`, two
    micro-batches as here): the same losses, and the pair's checkpoint resumes in the single process without
    it."""
    pair_dir = str(tmp_path / "pair")
    procs = launch(pair_dir, 4, extra=["--distributed-optimizer", "--micro-batch-size", "4"])
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, failure(err)
    assert "jaxseq:" in outs[0][0] and "jaxseq:" not in outs[1][0]  # only process 0 prints
    pair, single = losses(pair_dir), one_process
    assert sorted(pair) == [1, 2, 3, 4]
    for step in pair:
        assert abs(pair[step] - single[step]) <= 1e-5 * abs(single[step]), (step, pair[step], single[step])
    # The pair's checkpoint, restored by one process on 8 devices, continues like the single run.
    run(*ARGS, "--host-devices", "8", "--steps", "6", "--run-dir", pair_dir, "--resume", *MICRO)
    resumed = losses(pair_dir)
    for step in (5, 6):
        assert abs(resumed[step] - single[step]) <= 1e-5 * abs(single[step])


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(ACROSS_HOSTS))
def test_stages_context_and_fsdp_ranks_span_processes(layout, one_process, tmp_path):
    """2 processes × 4 devices with pipe=2 × data=2 × tensor=2 (a stage per process), context=2 × tensor=4 (a
    context rank per process) or fsdp=2 × tensor=4 (an FSDP rank per process) train with the losses of 1 process ×
    8 devices."""
    pair_dir = str(tmp_path / "pair")
    procs = launch(pair_dir, 3, extra=[*ACROSS_HOSTS[layout], *MICRO])
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, failure(err)
    if layout == "fsdp":
        assert "fsdp=2 × tensor=4" in outs[0][0]  # the banner names the mesh
    pair, single = losses(pair_dir), one_process
    assert sorted(pair) == [1, 2, 3]
    for step in pair:
        assert abs(pair[step] - single[step]) <= 1e-5 * abs(single[step]), (step, pair[step], single[step])


def test_a_process_reads_the_rows_its_devices_hold():
    """local_batch_rows on 8 devices seen as 2 hosts of 4: 1/2 of the rows when hosts split `data` or `fsdp`, all
    of them when they split `pipe` or `context` (each stage and context rank needs every row)."""
    import jax
    from jaxseq.config import ParallelConfig
    from jaxseq.mesh import make_mesh
    from jaxseq.parallel import distributed as D
    from jaxseq.sharding import batch_sharding

    host0 = set(jax.devices()[:4])
    for parallel, rows in ((ParallelConfig(data=2, tensor=4), slice(0, 4)),
                           (ParallelConfig(pipe=2, data=2, tensor=2), slice(0, 8)),
                           (ParallelConfig(context=2, tensor=4), slice(0, 8)),
                           (ParallelConfig(data=4, tensor=2), slice(0, 4)),
                           (ParallelConfig(fsdp=2, tensor=4), slice(0, 4))):
        sharding = batch_sharding(make_mesh(parallel))  # rows over data (× fsdp)
        held = {d: i for d, i in sharding.devices_indices_map((8, 16)).items() if d in host0}
        view = type("HostView", (), {"addressable_devices_indices_map": lambda self, shape: held})()
        assert D.local_batch_rows(view, 8, 16) == rows, parallel


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0], ids=["worker-killed", "coordinator-killed"])
def test_a_killed_peer_does_not_hang_the_other(victim, tmp_path):
    run_dir = str(tmp_path)
    procs = launch(run_dir, None, extra=[*UNFINISHED, "--heartbeat-timeout", "5"])
    path = os.path.join(run_dir, "metrics.jsonl")
    deadline = time.time() + 240
    while time.time() < deadline and not (os.path.exists(path) and len(open(path).readlines()) >= 2):
        time.sleep(0.5)
    assert os.path.exists(path), failure(procs[0].communicate(timeout=5)[1])
    procs[victim].send_signal(signal.SIGKILL)
    killed_at = time.time()
    survivor = procs[1 - victim]
    out, err = survivor.communicate(timeout=120)
    assert time.time() - killed_at < 45
    assert survivor.returncode != 0
    # Whichever notices first: the distributed runtime, after --heartbeat-timeout (5 s here) without the
    # peer's heartbeat (or at once when the coordinator is gone), stops the process with its verdict
    # ("another task died"); or a collective fails and jaxseq says so in one line.
    assert "another task died" in err or "error: the XLA runtime failed" in err, failure(err)


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_the_same_step(tmp_path):
    """The checkpoint save is collective: a signal that reaches one process must stop every process
    after the same step (it used to hang both, each saving a different step). The pair is started
    with the environment srun gives two tasks and no coordinator flags: JAX's SLURM detection."""
    run_dir = str(tmp_path)
    procs = launch(run_dir, None, extra=UNFINISHED, slurm=True)
    try:
        path = os.path.join(run_dir, "metrics.jsonl")
        deadline = time.time() + 240
        while time.time() < deadline and not (os.path.exists(path) and len(open(path).readlines()) >= 2):
            time.sleep(0.5)
        assert os.path.exists(path), failure(procs[0].communicate(timeout=5)[1])
        procs[1].send_signal(signal.SIGTERM)  # the worker only; process 0 must learn of it
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 143, failure(err)  # 128 + SIGTERM: stopped, not finished
    saved = sorted(int(d) for d in os.listdir(os.path.join(run_dir, "checkpoints")) if d.isdigit())
    last = max(losses(run_dir))
    assert saved == [last], (saved, last)
    assert "data=2 × tensor=4" in outs[0][0] and "jaxseq:" not in outs[1][0]  # two processes, one mesh
    assert f"SIGTERM: saved a checkpoint at step {last}" in outs[0][0]
    run(*ARGS, "--host-devices", "8", "--steps", str(last + 1), "--run-dir", run_dir, "--resume")
    assert sorted(losses(run_dir))[-2:] == [last, last + 1]


def test_bad_distributed_flags_give_one_clear_line():
    from jaxseq.config import ConfigError, DistributedConfig
    from jaxseq.parallel.distributed import validate_distributed

    for cfg, message in [(DistributedConfig(coordinator="127.0.0.1:99", num_processes=2, process_id=None),
                          "must be given together"),
                         (DistributedConfig(coordinator="nohost", num_processes=2, process_id=0),
                          "coordinator='nohost' is not HOST:PORT"),
                         (DistributedConfig(coordinator="h:1", num_processes=2, process_id=2),
                          "process_id=2 is not in [0, num_processes=2)")]:
        with pytest.raises(ConfigError) as err:
            validate_distributed(cfg)
        assert message in str(err.value)


SRUN_STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[01-04]", "SLURM_NTASKS": "4", "SLURM_PROCID": "1",
             "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "4"}
SALLOC = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_NNODES": "4", "SLURM_JOB_NODELIST": "node[01-04]"}
MPIRUN = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.0.0.1:34911"}
ENVIRONMENTS = [
    ({}, None),
    (SRUN_STEP, "SLURM"),
    (SALLOC, None),  # an salloc shell or a batch script: an allocation, no srun step
    ({k: v for k, v in SRUN_STEP.items() if k != "SLURM_LOCALID"}, None),
    (MPIRUN, "Open MPI"),
    # Open MPI 5 (PRRTE): no ORTE URI; JAX 0.12 reads its environment (and needs mpi4py), 0.10.2 does not.
    ({k: v for k, v in MPIRUN.items() if k != "OMPI_MCA_orte_hnp_uri"}, "Open MPI 5"),
]


@pytest.mark.parametrize("environ, launcher", ENVIRONMENTS)
def test_launcher_detection_agrees_with_jax(environ, launcher, monkeypatch):
    """jaxseq starts the distributed runtime exactly when JAX's own cluster detection would succeed."""
    from jax._src import clusters

    from jaxseq.parallel.distributed import LAUNCHERS, _jax_reads_open_mpi_5, detected_launcher

    if launcher == "Open MPI 5":
        launcher = "Open MPI" if _jax_reads_open_mpi_5() else None
    assert detected_launcher(environ) == launcher
    launcher_vars = {v for _, required in LAUNCHERS.values() for v in required} | {"OMPI_COMM_WORLD_SIZE"}
    clean = {k: v for k, v in os.environ.items() if k not in launcher_vars}
    monkeypatch.setattr(os, "environ", {**clean, **environ})
    jax_says = {name for name, (method, _) in LAUNCHERS.items()
                if next(c for c in clusters.ClusterEnv._cluster_types if c.name == method).is_env_present()}
    assert jax_says == ({launcher} if launcher else set())
    assert detected_launcher() == launcher  # asks JAX itself about os.environ


def test_an_incomplete_launcher_environment_is_one_line():
    from jaxseq.config import ConfigError
    from jaxseq.parallel.distributed import incomplete_launcher

    assert incomplete_launcher({}) is None
    note = incomplete_launcher(SALLOC)
    assert note.startswith("SLURM job without SLURM_STEP_NODELIST, SLURM_PROCID, SLURM_LOCALID") and "\n" not in note
    assert "running as one process" in note
    one = {"OMPI_COMM_WORLD_SIZE": "1"}
    assert incomplete_launcher(one) == "Open MPI without OMPI_MCA_orte_hnp_uri: running as one process"
    with pytest.raises(ConfigError, match="Open MPI started 4 processes without OMPI_MCA_orte_hnp_uri .Open MPI 5 "
                                          "no longer sets it, and this JAX reads only Open MPI 4's environment."):
        incomplete_launcher({k: v for k, v in MPIRUN.items() if k != "OMPI_MCA_orte_hnp_uri"})


def test_open_mpi_5_without_mpi4py_is_one_line(monkeypatch):
    """Where JAX reads Open MPI 5's environment it finds the coordinator through mpi4py; without it, one line
    instead of JAX's RuntimeError from inside initialize."""
    import importlib.util

    from jaxseq.config import ConfigError, DistributedConfig
    from jaxseq.parallel import distributed as D

    ompi5 = dict({k: v for k, v in MPIRUN.items() if k != "OMPI_MCA_orte_hnp_uri"}, OMPI_VERSION="5.0.3")
    assert D.open_mpi_5(ompi5) and not D.open_mpi_5(MPIRUN)
    assert D.open_mpi_5({k: v for k, v in ompi5.items() if k != "OMPI_VERSION"})  # no ORTE URI: PRRTE
    monkeypatch.setattr(D, "_jax_reads_open_mpi_5", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert D.detected_launcher(ompi5) == "Open MPI"
    with pytest.raises(ConfigError, match="Open MPI 5 started 4 processes; JAX finds their coordinator through "
                                          "mpi4py, which is not installed"):
        D.initialize(DistributedConfig(), ompi5)


def test_one_process_per_host_drives_every_local_device():
    """JAX's SLURM and Open MPI detection make each process drive only its local-rank device (one
    process per GPU); launched one per host, jaxseq asks for all of them."""
    from jaxseq.config import DistributedConfig
    from jaxseq.parallel.distributed import initialize_kwargs

    cfg = DistributedConfig()
    one_per_node = initialize_kwargs(cfg, "SLURM", SRUN_STEP)
    assert one_per_node["cluster_detection_method"] == "slurm" and one_per_node["local_device_ids"] == []
    per_gpu = dict(SRUN_STEP, SLURM_STEP_NUM_TASKS="32", SLURM_NTASKS="32")  # 8 tasks on each of 4 nodes
    assert "local_device_ids" not in initialize_kwargs(cfg, "SLURM", per_gpu)
    assert initialize_kwargs(cfg, "Open MPI", MPIRUN)["local_device_ids"] == []
    assert "local_device_ids" not in initialize_kwargs(cfg, "Open MPI", dict(MPIRUN, OMPI_COMM_WORLD_LOCAL_SIZE="8"))
    explicit = initialize_kwargs(DistributedConfig(coordinator="h:1", num_processes=2, process_id=1), None, SRUN_STEP)
    assert (explicit["coordinator_address"], explicit["num_processes"], explicit["process_id"]) == ("h:1", 2, 1)
    assert "cluster_detection_method" not in explicit


@pytest.mark.slow
def test_an_salloc_shell_trains_in_one_process(tmp_path, monkeypatch):
    """SLURM_JOB_ID without an srun step used to end in JAX's `coordinator_address should be defined`."""
    for name, value in SALLOC.items():
        monkeypatch.setenv(name, value)
    proc = run(*ARGS, "--host-devices", "8", "--steps", "1", "--run-dir", str(tmp_path), "sample_tokens=0", check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "note: SLURM job without SLURM_STEP_NODELIST" in proc.stderr
    assert sorted(losses(str(tmp_path))) == [1]
