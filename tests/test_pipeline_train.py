"""`python -m jaxseq.train` with a pipeline: the same losses as pipe=1, resume across pipe sizes, one-line errors."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from commands import ROOT, assert_succeeded, command, env
from jaxseq import convert as convert_command
from jaxseq import generate as generate_command
from jaxseq.config import ConfigError, ParallelConfig, replace, validate
from jaxseq.presets import preset
from test_train import losses, run

# 4 layers (divisible by p = 2 and 4), m = 8 / 2 = 4 micro-batches, dropout on (the tiny preset's 0.1).
BASE = ["--preset", "tiny", "--dtype", "float32", "--batch-size", "8", "--micro-batch-size", "2", "layers=4",
        "decay_steps=10", "--log-every", "1", "--eval-every", "100", "--warmup-steps", "2", "eval_batches=1",
        "sample_tokens=8"]
PIPE1 = ["--host-devices", "4", "--mesh", "data=2,tensor=2"]
PIPE2 = ["--host-devices", "8", "--mesh", "pipe=2,data=2,tensor=2", "--schedule", "1f1b"]
PIPE4 = ["--host-devices", "8", "--mesh", "pipe=4,data=2,tensor=1", "--schedule", "gpipe"]


def _on_4_devices(*runs):
    """pipe=1 runs on data=2 × tensor=2, the pipe=2 run's data and tensor sizes, one after the other in one new
    process (`train.main(argv)` each, as `python -m jaxseq.train argv` runs it): its 4 simulated devices are not the
    pytest process's 8. (On 8 devices, tensor=4 moves the step-2 weights further from the pipelined run's than
    test_generate_and_convert_on_a_pipelined_run allows.) One process for the reference and the resume, not one
    each (a process's start, 3 s); with the tests' compilation cache (`commands.env`): the resumed run loads the
    reference run's programs (its start-up is not what is tested here; tests/test_train.py starts the command
    cold)."""
    script = ("import json, sys\nfrom jaxseq import train\n"
              "for argv in json.loads(sys.argv[1]):\n    if code := train.main(argv):\n        sys.exit(code)\n")
    assert_succeeded(subprocess.run([sys.executable, "-c", script, json.dumps(runs)], capture_output=True, text=True,
                                    cwd=ROOT, env=env(cache=True), timeout=240))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """pipe=1 for 4 steps (the reference, a checkpoint every 2 steps); pipe=2 (1F1B, data=2, tensor=2 + SP,
    the distributed optimizer) for 2 steps; that run resumed on pipe=1 (in the reference's process, after it) and on
    pipe=4 (GPipe) to step 4."""
    tmp = tmp_path_factory.mktemp("pipetrain")
    ref, piped, to_pipe1, to_pipe4 = (str(tmp / n) for n in ("ref", "piped", "to1", "to4"))
    out = run(*BASE, *PIPE2, "--distributed-optimizer", "--steps", "2", "--run-dir", piped)
    assert "sample (prompt" in out.stdout
    shutil.copytree(piped, to_pipe1)
    shutil.copytree(piped, to_pipe4)
    # Only the pipelined run draws the end-of-run sample (from a pipeline's weights); the others compile no sampler.
    _on_4_devices([*BASE, *PIPE1, "--steps", "4", "--checkpoint-every", "2", "--run-dir", ref, "sample_tokens=0"],
                  [*BASE, *PIPE1, "--steps", "4", "--run-dir", to_pipe1, "--resume", "sample_tokens=0"])
    run(*BASE, *PIPE4, "--steps", "4", "--run-dir", to_pipe4, "--resume", "sample_tokens=0")
    return {"ref": ref, "piped": piped, "to1": to_pipe1, "to4": to_pipe4, "piped_stdout": out.stdout}


@pytest.mark.slow
def test_pipelined_training_matches_pipe1_and_resumes_on_other_pipe_sizes(runs):
    """pipe=2 trains 2 steps with the losses of pipe=1 (gradient accumulation over the same 4 micro-batches,
    no distributed optimizer); its checkpoint resumes on pipe=1 and on pipe=4 with the reference's losses
    for steps 3 and 4."""
    assert "mesh pipe=2 × data=2 × tensor=2 + SP + distributed optimizer, 1f1b schedule (v=1, m=4 micro-batches, " \
        "10 ticks" in runs["piped_stdout"]
    reference = losses(runs["ref"])
    for got, steps in ((losses(runs["piped"]), (1, 2)), (losses(runs["to1"]), (3, 4)), (losses(runs["to4"]), (3, 4))):
        for step in steps:
            assert abs(got[step] - reference[step]) <= 1e-5 * abs(reference[step]), (step, got[step], reference[step])


@pytest.mark.slow
def test_generate_and_convert_on_a_pipelined_run(runs, tmp_path):
    """`python -m jaxseq.generate` and `python -m jaxseq.convert to-hf` read the pipe=2 run directory (saved
    with the distributed optimizer, config.json saying pipe=2): the same text and the same HF tensors as
    from the same checkpoint under the pipe=1 config (its copy resumed on pipe=1), and HF tensors equal to
    the pipe=1 reference's step-2 weights (trained without a pipeline) within f32 training noise: 1e-5 of each
    tensor's largest entry, and 1e-7 at least, since the key bias's gradient is zero in exact arithmetic (softmax
    is shift-invariant) and Adam makes its entries from rounding alone (about 1e-8 here), which two differently
    compiled programs round differently."""
    piped, same_on_pipe1, ref = runs["piped"], os.path.join(runs["to1"], "checkpoints", "2"), \
        os.path.join(runs["ref"], "checkpoints", "2")
    assert json.load(open(os.path.join(runs["to1"], "config.json")))["parallel"]["pipe"] == 1
    texts = [command(generate_command.main, "--run-dir", d, "--prompt", "def ", "--max-tokens", "12").stdout
             for d in (piped, same_on_pipe1)]
    assert texts[0] == texts[1] and texts[0].startswith("# step 2\ndef ")
    tensors = []
    for name, d in (("piped", piped), ("pipe1", same_on_pipe1), ("ref", ref)):
        command(convert_command.main, "to-hf", d, str(tmp_path / name))
        tensors.append(load_file(str(tmp_path / name / "model.safetensors")))
    assert tensors[0].keys() == tensors[1].keys() == tensors[2].keys()
    for k in tensors[0]:
        np.testing.assert_array_equal(tensors[0][k], tensors[1][k], err_msg=k)
        scale = np.max(np.abs(tensors[2][k])) or 1.0
        np.testing.assert_allclose(tensors[0][k], tensors[2][k], rtol=0, atol=max(1e-5 * scale, 1e-7), err_msg=k)


@pytest.mark.parametrize("parallel,layers,batch,micro,message", [
    (ParallelConfig(data=2, tensor=2, pipe=2), 4, 8, 2, None),
    (ParallelConfig(data=1, tensor=1, pipe=2, schedule="interleaved", virtual_stages=2), 6, 8, 2,
     "layers=6 is not divisible by pipe×virtual_stages = 2×2"),
    (ParallelConfig(data=2, tensor=1, pipe=4), 4, 8, 4, "microbatches=2 is fewer than pipe=4"),
    (ParallelConfig(data=1, tensor=1, pipe=4, schedule="interleaved", virtual_stages=2), 8, 16, 2, None),
    (ParallelConfig(data=1, tensor=2, pipe=4, schedule="interleaved", virtual_stages=2), 8, 16, 2, None),
    (ParallelConfig(data=1, tensor=2, pipe=4, schedule="interleaved", virtual_stages=2), 8, 10, 2,
     "not a multiple of pipe=4"),
    (ParallelConfig(data=2, tensor=2, pipe=3), 3, 8, 2,
     "pipe×data×tensor = 3×2×2 = 12 does not equal the device count 8"),
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


@pytest.mark.slow
def test_plan_prices_the_first_stage_by_the_schedule(devices):
    """jaxseq.plan --pipeline 2 --schedule interleaved --virtual-stages 2 --microbatches 4: the first stage
    holds L·(1 + (p−1)/(p·v)) layers' activations (5 of 4 layers), read from the pipelined step compiled on
    p × t = 2 devices, and the bubble is (p−1)/(v·m)."""
    from jaxseq.planning import plan as P, report
    from jaxseq.planning.memory import non_layer_activation_bytes

    cfg = replace(preset("tiny"), layers=4, dtype="float32")
    p = P.plan(cfg, 1, 2, devices[:2], "tiny", pipeline=2, policies=["selective"], schedule="interleaved",
               virtual_stages=2, microbatches=4)
    assert p.in_flight_layers == 4 * (1 + 1 / 4) == 5
    assert p.bubble == p.paper_bubble == 1 / 8
    row = p.row("selective")
    assert row.activation_bytes_per_device == 5 * row.measured_bytes_per_layer + non_layer_activation_bytes(
        cfg, 2, 1, False)
    text = report.format_table(p)
    assert "scaled    to 1 layers per chunk: 5 × 1 = 5 layers' worth" in text
    assert "formula   the paper's L·(1 + (p−1)/(p·v)) = 5 layers" in text
    with pytest.raises(ConfigError, match="not a multiple of pipe=2"):
        P.plan(cfg, 1, 2, devices[:1], pipeline=2, schedule="interleaved", virtual_stages=2, microbatches=3)
