"""`python -m jaxseq.train` with a pipeline: the same losses as pipe=1, resume across pipe sizes, one-line errors."""

import shutil

import pytest

from jaxseq.config import ConfigError, ParallelConfig, preset, replace, validate
from test_train import losses, run

# 4 layers (divisible by p = 2 and 4), m = 8 / 2 = 4 micro-batches, dropout on (the tiny preset's 0.1).
BASE = ["--preset", "tiny", "--dtype", "float32", "--batch-size", "8", "--micro-batch-size", "2", "layers=4",
        "decay_steps=10", "--log-every", "1", "--eval-every", "100", "--warmup-steps", "2", "eval_batches=1",
        "sample_tokens=8"]
PIPE1 = ["--host-devices", "4", "--mesh", "data=2,tensor=2"]
PIPE2 = ["--host-devices", "8", "--mesh", "pipe=2,data=2,tensor=2", "--schedule", "1f1b"]
PIPE4 = ["--host-devices", "8", "--mesh", "pipe=4,data=2,tensor=1", "--schedule", "gpipe"]


def test_pipelined_training_matches_pipe1_and_resumes_on_other_pipe_sizes(tmp_path):
    """pipe=2 (1F1B, data=2, tensor=2 + SP, with the distributed optimizer) trains 2 steps with the
    losses of pipe=1 (gradient accumulation over the same 4 micro-batches, no distributed optimizer);
    its checkpoint resumes on pipe=1 and on pipe=4 (GPipe) with the reference's losses for steps 3 and 4."""
    ref, piped, to_pipe1, to_pipe4 = (str(tmp_path / n) for n in ("ref", "piped", "to1", "to4"))
    run(*BASE, *PIPE1, "--steps", "4", "--run-dir", ref)
    out = run(*BASE, *PIPE2, "--distributed-optimizer", "--steps", "2", "--run-dir", piped)
    assert "mesh pipe=2 × data=2 × tensor=2 + SP + distributed optimizer, 1f1b schedule (v=1, m=4 micro-batches, 10 ticks" in out.stdout
    shutil.copytree(piped, to_pipe1)
    shutil.copytree(piped, to_pipe4)
    run(*BASE, *PIPE1, "--steps", "4", "--run-dir", to_pipe1, "--resume")
    run(*BASE, *PIPE4, "--steps", "4", "--run-dir", to_pipe4, "--resume")
    reference = losses(ref)
    for got, steps in ((losses(piped), (1, 2)), (losses(to_pipe1), (3, 4)), (losses(to_pipe4), (3, 4))):
        for step in steps:
            assert abs(got[step] - reference[step]) <= 1e-5 * abs(reference[step]), (step, got[step], reference[step])


@pytest.mark.parametrize("parallel,layers,batch,micro,message", [
    (ParallelConfig(2, 2, pipe=2), 4, 8, 2, None),
    (ParallelConfig(1, 1, pipe=2, schedule="interleaved", virtual_stages=2), 6, 8, 2,
     "layers=6 is not divisible by pipe×virtual_stages = 2×2"),
    (ParallelConfig(2, 1, pipe=4), 4, 8, 4, "microbatches=2 is fewer than pipe=4"),
    (ParallelConfig(1, 1, pipe=4, schedule="interleaved", virtual_stages=2), 8, 16, 2, None),
    (ParallelConfig(1, 2, pipe=4, schedule="interleaved", virtual_stages=2), 8, 16, 2, None),
    (ParallelConfig(1, 2, pipe=4, schedule="interleaved", virtual_stages=2), 8, 10, 2, "not a multiple of pipe=4"),
    (ParallelConfig(2, 2, pipe=3), 3, 8, 2, "pipe×data×tensor = 3×2×2 = 12 does not equal the device count 8"),
])
def test_bad_pipeline_configs_are_one_line_errors(parallel, layers, batch, micro, message):
    model = replace(preset("tiny"), layers=layers)
    devices = 8 if message and "device count" in message else parallel.num_devices
    if message is None:
        validate(model, parallel, "selective", devices, batch, micro)
        return
    with pytest.raises(ConfigError, match=message) as e:
        validate(model, parallel, "selective", devices, batch, micro)
    assert "\n" not in str(e.value)


def test_cli_rejects_a_mesh_that_does_not_fit(tmp_path):
    proc = run(*BASE, "--host-devices", "8", "--mesh", "pipe=4,data=2,tensor=2", "--steps", "1",
               "--run-dir", str(tmp_path), check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: pipe×data×tensor = 4×2×2 = 16 does not equal the device count 8"]


def test_plan_prices_the_first_stage_by_the_schedule(devices):
    """jaxseq.plan --pipeline 2 --schedule interleaved --virtual-stages 2 --microbatches 4: the first stage
    holds L·(1 + (p−1)/(p·v)) layers' activations (5 of 4 layers), read from the pipelined step compiled on
    p × t = 2 devices, and the bubble is (p−1)/(v·m)."""
    from jaxseq import plan as P

    cfg = replace(preset("tiny"), layers=4, dtype="float32")
    p = P.plan(cfg, 1, 2, devices[:2], "tiny", pipeline=2, policies=["selective"], schedule="interleaved",
               virtual_stages=2, microbatches=4)
    assert p.in_flight_layers == 4 * (1 + 1 / 4) == 5
    assert p.bubble == p.paper_bubble == 1 / 8
    row = p.row("selective")
    assert row.activation_bytes_per_device == 5 * row.measured_bytes_per_layer + P.non_layer_activation_bytes(
        cfg, 2, 1, False)
    text = P.format_table(p)
    assert "scaled    to 1 layers per chunk: 5 × 1 = 5 layers' worth" in text
    assert "formula   the paper's L·(1 + (p−1)/(p·v)) = 5 layers" in text
    with pytest.raises(ConfigError, match="not a multiple of pipe=2"):
        P.plan(cfg, 1, 2, devices[:1], pipeline=2, schedule="interleaved", virtual_stages=2, microbatches=3)
