"""Two local processes × 4 simulated CPU devices, through jax.distributed (gloo collectives)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from test_train import ROOT, env, losses, run

ARGS = ["--preset", "tiny", "--dtype", "float32", "--batch-size", "8", "--mesh", "data=2,tensor=4",
        "--sequence-parallel", "--remat", "selective", "--log-every", "1", "--eval-every", "100",
        "--warmup-steps", "2", "decay_steps=10", "eval_batches=1", "sample_tokens=4"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run_dir, steps, extra=()):
    port = free_port()
    return [subprocess.Popen(
        [sys.executable, "-m", "jaxseq.train", *ARGS, "--host-devices", "4", "--steps", str(steps),
         "--run-dir", run_dir, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
         "--process-id", str(i), *extra],
        cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]


def test_two_processes_match_one_and_their_checkpoint_restores_in_one(tmp_path):
    """The pair runs with the distributed optimizer (its state split over data across the two
    processes), the single process without it: the same losses, and the pair's checkpoint resumes
    in the single process without it."""
    pair_dir, single_dir = str(tmp_path / "pair"), str(tmp_path / "single")
    procs = launch(pair_dir, 4, extra=["--distributed-optimizer"])
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert "jaxseq:" in outs[0][0] and "jaxseq:" not in outs[1][0]  # only process 0 prints
    run(*ARGS, "--host-devices", "8", "--steps", "6", "--run-dir", single_dir)
    pair, single = losses(pair_dir), losses(single_dir)
    assert sorted(pair) == [1, 2, 3, 4]
    for step in pair:
        assert abs(pair[step] - single[step]) <= 1e-5 * abs(single[step]), (step, pair[step], single[step])
    # The pair's checkpoint, restored by one process on 8 devices, continues like the single run.
    run(*ARGS, "--host-devices", "8", "--steps", "6", "--run-dir", pair_dir, "--resume")
    resumed = losses(pair_dir)
    for step in (5, 6):
        assert abs(resumed[step] - single[step]) <= 1e-5 * abs(single[step])


@pytest.mark.parametrize("victim", [1, 0], ids=["worker-killed", "coordinator-killed"])
def test_a_killed_peer_does_not_hang_the_other(victim, tmp_path):
    run_dir = str(tmp_path)
    procs = launch(run_dir, 100000, extra=["--checkpoint-every", "100000"])
    path = os.path.join(run_dir, "metrics.jsonl")
    deadline = time.time() + 240
    while time.time() < deadline and not (os.path.exists(path) and len(open(path).readlines()) >= 2):
        time.sleep(0.5)
    assert os.path.exists(path), procs[0].communicate(timeout=5)[1][-3000:]
    procs[victim].send_signal(signal.SIGKILL)
    killed_at = time.time()
    survivor = procs[1 - victim]
    out, err = survivor.communicate(timeout=120)
    assert time.time() - killed_at < 60
    assert survivor.returncode != 0
    # Whichever notices first: the distributed runtime, after heartbeat_timeout_s (20 s) without the
    # peer's heartbeat (or at once when the coordinator is gone), stops the process with its verdict
    # ("another task died"); or a collective fails and jaxseq says so in one line.
    assert "another task died" in err or "error: the XLA runtime failed" in err, err[-3000:]


def test_bad_distributed_flags_give_one_clear_line():
    from jaxseq.config import ConfigError, DistributedConfig
    from jaxseq.distributed import detected_launcher, validate_distributed

    for cfg, message in [(DistributedConfig("127.0.0.1:99", 2, None), "must be given together"),
                         (DistributedConfig("nohost", 2, 0), "coordinator='nohost' is not HOST:PORT"),
                         (DistributedConfig("h:1", 2, 2), "process_id=2 is not in [0, num_processes=2)")]:
        with pytest.raises(ConfigError) as err:
            validate_distributed(cfg)
        assert message in str(err.value)
    assert detected_launcher({"SLURM_JOB_ID": "7"}) == "SLURM"
    assert detected_launcher({"OMPI_COMM_WORLD_SIZE": "2"}) == "Open MPI"
    assert detected_launcher({}) is None
