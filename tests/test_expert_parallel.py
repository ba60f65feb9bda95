"""Expert parallelism: a mixture of experts' experts split over the `expert` mesh axis, each MoE layer's tokens sent
to their experts' ranks and back by one all-to-all each way (models/experts.py), the axis a data axis to everything
else (mesh.py, parallel/layout.py, parallel/data_parallel.py, parallel/pipeline.py).

Against one device (float32, dropless so that no group drops what one device keeps, the balancing loss and z-loss
on): the loss and every gradient the step hands to the optimizer in four layouts (expert × data; with tensor + SP;
with FSDP and accumulation; inside a 1F1B pipeline); the train command's losses and validation losses, resumed onto
another expert size; two processes whose expert ranks span them. From the compiled program: the collectives of a
MoE layer. Refusals in one line."""

import json
import os
from functools import lru_cache

import jax
import numpy as np
import pytest

from commands import command, python_m
from compiled_steps import counting_batch
from jaxseq import train as train_command
from jaxseq.config import ConfigError, ParallelConfig, replace, validate
from jaxseq.presets import preset
from jaxseq.mesh import make_mesh
from jaxseq.models import model
from jaxseq.parallel.layout import Layout
from jaxseq.planning import hlo_collectives
from test_distributed import failure, launch
from jaxseq.planning import moe as moe_plan
from jaxseq.training import train_step

CFG = replace(preset("tiny-moe"), dtype="float32", moe_capacity_factor=None, moe_z_loss_coef=0.01)
ROWS = 16
LAYOUTS = {  # name → (layout, micro-batches)
    "expert=4,data=2": (ParallelConfig(expert=4, data=2), 1),
    "expert=2,tensor=2,data=2+sp": (ParallelConfig(expert=2, tensor=2, data=2, sequence_parallel=True), 1),
    "expert=2,fsdp=2,data=2 m=2": (ParallelConfig(expert=2, fsdp=2, data=2), 2),
    "pipe=2,expert=2,data=2 1f1b m=2": (ParallelConfig(pipe=2, expert=2, data=2), 2),
}


@lru_cache(maxsize=None)
def step_gradients(parallel: ParallelConfig, micro_batches: int, cfg=CFG):
    """(loss, float32 gradients as numpy, the optimized HLO) of `train_step.step_gradients` on `parallel`."""
    mesh = make_mesh(parallel, jax.devices()[: parallel.num_devices])
    layout = Layout(cfg, parallel, mesh)
    params = jax.device_put(model.init_params(jax.random.key(0), cfg, parallel.tensor), layout.master_shardings)
    batch, key = counting_batch(cfg, ROWS, 0), jax.random.key(1)
    step = jax.jit(train_step.step_gradients(layout, "selective", micro_batches))
    compiled = step.lower(params, batch, key).compile()
    loss, grads = compiled(params, batch, key)
    return float(loss), jax.tree.map(np.asarray, grads), compiled.as_text()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loss_and_every_gradient_equal_one_device(devices, name):
    parallel, micro_batches = LAYOUTS[name]
    loss, grads, _ = step_gradients(parallel, micro_batches)
    want_loss, want, _ = step_gradients(ParallelConfig(), micro_batches)
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss)
    for (path, got), ref in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want)):
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), jax.tree_util.keystr(path)


def expert_groups(parallel: ParallelConfig) -> set[tuple[int, ...]]:
    """The device groups of the `expert` axis of `parallel`'s data × expert × tensor mesh."""
    ids = np.arange(parallel.num_devices).reshape(parallel.data, parallel.expert, parallel.tensor)
    return {tuple(ids[d, :, t]) for d in range(parallel.data) for t in range(parallel.tensor)}


def over_expert(collective, parallel: ParallelConfig) -> bool:
    """Whether a collective's groups hold devices of different expert ranks."""
    rank = lambda device: device // parallel.tensor % parallel.expert
    return bool(collective.groups) and any(len({rank(d) for d in group}) > 1 for group in collective.groups)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["expert=4,data=2", "expert=2,tensor=2,data=2+sp"])
def test_each_moe_layer_has_one_all_to_all_each_way_a_pass_and_no_other_collective_over_expert(devices, name):
    """Per layer loop iteration, forward and backward (`selective`, which keeps the experts' input and output): two
    all-to-alls over exactly the expert groups (dispatch, combine; in backward their transposes), of [E, C, h]
    float32 each; over `expert` besides them only the forward's all-reduce of the experts' loads (E int32, the
    balancing loss's counts over the micro-batch: data × expert)."""
    parallel, _ = LAYOUTS[name]
    text = step_gradients(parallel, 1)[2]
    tokens = ROWS // (parallel.data * parallel.expert) * CFG.seq_len  # a group's; dropless: C = T slots an expert
    for backward in (False, True):
        found = [c for c in hlo_collectives.loop_collectives(text, CFG.layers, backward) if over_expert(c, parallel)]
        to_all = [c for c in found if c.kind == "all-to-all"]
        assert len({c.instruction for c in to_all}) == 2
        assert all(set(c.groups) == expert_groups(parallel) for c in to_all)
        assert sum(c.elements for c in to_all) == 2 * CFG.moe_experts * tokens * CFG.hidden
        assert sum(c.elements for c in to_all) == moe_plan.all_to_all_elements(CFG, tokens)  # the plan's count
        others = [(c.kind, c.elements) for c in found if c.kind != "all-to-all"]
        assert others == ([] if backward else [("all-reduce", CFG.moe_experts)])


def test_zero_bubble_with_experts_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="schedule=zb-h1 with a mixture of experts is not supported"):
        validate(CFG, ParallelConfig(pipe=2, expert=2, data=2, schedule="zb-h1"), "selective")


# The train command: float32, dropless, 2 micro-batches of 8 rows, an evaluation and a checkpoint every step.
BASE = ["--preset", "tiny-moe", "--dtype", "float32", "dropout=0.0", "moe_capacity_factor=none", "--batch-size", "16",
        "--micro-batch-size", "8", "decay_steps=10", "--warmup-steps", "0", "--log-every", "1", "--eval-every", "1",
        "eval_batches=1", "--checkpoint-every", "1", "sample_tokens=0"]


def records(run_dir: str) -> dict[int, dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if "run" not in r}  # not the closing time record


@pytest.fixture(scope="module")
def one_device(tmp_path_factory) -> dict[int, dict]:
    """3 steps on one device (a new process: the pytest process has 8)."""
    run_dir = str(tmp_path_factory.mktemp("one-device"))
    python_m("jaxseq.train", *BASE, "--host-devices", "1", "--mesh", "data=1", "--steps", "3", "--run-dir", run_dir,
             check=True, timeout=600)
    return records(run_dir)


def assert_losses(got: dict, want: dict, steps) -> None:
    for step in steps:
        for key in ("loss", "val_loss"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-5), (step, key)


@pytest.mark.slow
def test_the_train_command_gives_one_devices_losses_and_resumes_onto_another_expert_size(one_device, tmp_path):
    """Two steps at expert=4 × data=2, checkpointed, resumed for a third at expert=2 × data=2 × tensor=2 + SP."""
    first = command(train_command.main, *BASE, "--host-devices", "8", "--mesh", "expert=4,data=2", "--steps", "2",
                    "--run-dir", str(tmp_path))
    assert "data=2 × expert=4 × tensor=1" in first.stdout
    resumed = command(train_command.main, *BASE, "--host-devices", "8", "--mesh", "expert=2,data=2,tensor=2",
                      "--sequence-parallel", "--steps", "3", "--resume", "--run-dir", str(tmp_path))
    assert "mesh data=2 × expert=4 × tensor=1 → data=2 × expert=2 × tensor=2" in resumed.stdout
    assert_losses(records(str(tmp_path)), one_device, (1, 2, 3))


@pytest.mark.slow
def test_two_processes_whose_expert_ranks_span_them_give_one_devices_losses(one_device, tmp_path):
    """2 processes × 4 devices, expert=2 × tensor=4 + SP: each process one expert rank, every all-to-all between
    them."""
    procs = launch(str(tmp_path), 3, extra=["--mesh", "expert=2,tensor=4", "--sequence-parallel"], base=BASE)
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, failure(err)
    assert "expert=2 × tensor=4" in outs[0][0]
    assert_losses(records(str(tmp_path)), one_device, (1, 2, 3))
