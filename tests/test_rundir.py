"""The run directory's restores onto a mesh: host weights placed (`rundir.place`), a checkpoint's params read
shard by shard onto another mesh (`rundir.restore`), and `--init-from` (`rundir.init_state`)."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxseq.config import OptimizerConfig, ParallelConfig, RunConfig, TrainConfig, replace
from jaxseq.presets import preset
from jaxseq.mesh import make_mesh
from jaxseq.models import model as M
from jaxseq.training import checkpoint as C
from jaxseq.training import rundir
from jaxseq.training import train_step as T
from jaxseq.parallel.layout import Layout


@pytest.mark.parametrize("parallel", [ParallelConfig(pipe=2, data=2, tensor=2, sequence_parallel=True),
                                      ParallelConfig(pipe=2, data=1, tensor=4)], ids=["p2d2t2sp", "p2t4"])
def test_place_shards_layers_over_pipe_as_the_train_step_does(parallel, devices):
    """The layers land split over `pipe` (the train step's specs for this mesh), each device holding 1/(p·t)
    of a tensor-split layer weight; the values are the host copy's. Before, `place` built its ParallelConfig
    by position, so the pipe size landed in `distributed_optimizer` and the layers were replicated."""
    cfg = preset("tiny")
    host = jax.tree.map(np.asarray, M.init_params(jax.random.key(0), cfg, 1))
    placed = rundir.place(host, cfg, make_mesh(parallel, devices), parallel.sequence_parallel)
    for leaf, spec in zip(jax.tree.leaves(placed), jax.tree.leaves(M.param_specs(cfg, parallel))):
        assert leaf.sharding.spec == spec
    kernel = placed["layers"]["mlp"]["wi"]["kernel"]  # [L, h, f]: layers over pipe, f over tensor
    assert kernel.addressable_shards[0].data.size == kernel.size // (parallel.pipe * parallel.tensor)
    np.testing.assert_array_equal(np.asarray(kernel), host["layers"]["mlp"]["wi"]["kernel"])


CFG = replace(preset("tiny"), vocab_size=300, layers=4, dtype="float32")  # 512 rows at t = 2 and 4, 1024 at 8


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, devices):
    """A run directory whose checkpoint (step 3) was written on pipe=2 × data=2 × tensor=2 with the distributed
    optimizer (layers over pipe, masters split over data), and the state it saved, on the host."""
    run_dir = str(tmp_path_factory.mktemp("saved"))
    parallel = ParallelConfig(pipe=2, data=2, tensor=2, distributed_optimizer=True)
    mesh = make_mesh(parallel, devices)
    optimizer = T.make_optimizer(OptimizerConfig(), CFG)
    state = T.init_state(jax.random.key(0), Layout(CFG, parallel, mesh), optimizer)
    state = T.TrainState(jnp.int32(3), state.params, state.opt_state)
    run = RunConfig(model=CFG, parallel=parallel, optimizer=OptimizerConfig(), train=TrainConfig(run_dir=run_dir))
    rundir.write_config(run_dir, run)
    mgr = C.manager(rundir.checkpoint_dir(run_dir), async_save=False)
    C.save(mgr, 3, state, rundir.checkpoint_meta(run, 3), force=True)
    mgr.wait_until_finished()
    return run_dir, jax.tree.map(np.asarray, state.params)


def shard_shape(leaf) -> tuple[int, ...]:
    """The shape one device's shard of `leaf` must have under its sharding: every split dimension divided."""
    mesh, spec = leaf.sharding.mesh, tuple(leaf.sharding.spec) + (None,) * leaf.ndim
    return tuple(n // (math.prod(mesh.shape[a] for a in (axis if isinstance(axis, tuple) else (axis,)))
                       if axis else 1) for n, axis in zip(leaf.shape, spec))


@pytest.mark.parametrize("target", [ParallelConfig(data=2, tensor=4), ParallelConfig(pipe=4, data=1, tensor=2),
                                    ParallelConfig(data=1, tensor=8)], ids=["d2t4", "p4t2", "t8"])
def test_restore_reads_the_params_onto_another_mesh_shard_by_shard(saved_run, devices, target):
    """Saved on pipe=2 × data=2 × tensor=2, read onto meshes whose tensor and pipe sizes differ: the params (only)
    arrive in the train step's specs for that mesh, each device holding only its shard, equal to what was
    saved; the vocabulary is re-padded for the new tensor size (zeros past the saved rows)."""
    run_dir, saved = saved_run
    mesh = make_mesh(target, devices)
    restored = rundir.restore(run_dir, target, mesh)
    assert restored.step == 3 and restored.model == CFG and set(restored.params) == set(saved)
    specs = Layout(CFG, target).master_specs  # the train step's (the embedding group split over pipe at p4t2)
    for leaf, spec, want in zip(jax.tree.leaves(restored.params), jax.tree.leaves(specs),
                                jax.tree.leaves(saved)):
        assert leaf.sharding.mesh == mesh and leaf.sharding.spec == spec and leaf.dtype == np.float32
        assert all(s.data.shape == shard_shape(leaf) for s in leaf.addressable_shards)
        if leaf.shape != want.shape:  # the token embedding, padded for tensor=8: zeros past the saved rows
            assert leaf.shape == (CFG.padded_vocab(target.tensor), CFG.hidden) == (1024, CFG.hidden)
            want = np.pad(want, ((0, leaf.shape[0] - want.shape[0]), (0, 0)))
        np.testing.assert_array_equal(np.asarray(leaf), want)
    kernel = restored.params["layers"]["mlp"]["wi"]["kernel"]  # [L, h, f]: a 1/(pipe·tensor) block per device
    assert kernel.addressable_shards[0].data.size == kernel.size // (target.pipe * target.tensor)


def test_restore_in_the_compute_dtype_with_fewer_positions(saved_run, devices):
    """What generate reads: the weights the step copies to bfloat16 arrive in bfloat16 (LayerNorms stay float32),
    and a shorter seq_len cuts the position table."""
    run_dir, saved = saved_run
    parallel = ParallelConfig(data=2, tensor=4)
    restored = rundir.restore(run_dir, parallel, make_mesh(parallel, devices), dtype="bfloat16", seq_len=16)
    assert restored.params["layers"]["attn"]["q"]["kernel"].dtype == jnp.bfloat16
    assert restored.params["layers"]["ln1"]["scale"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(restored.params["embed"]["position"]),
                                  saved["embed"]["position"][:16].astype(jnp.bfloat16))


def test_init_from_reads_the_params_straight_into_the_train_steps_shards(saved_run, devices, monkeypatch):
    """`--init-from` on pipe=4 × data=2 × tensor=1 with the distributed optimizer: orbax is asked for the params
    alone (no Adam moments), straight in the train step's master shardings of that mesh (no one-device copy);
    the state starts at step 0 with zero moments in the train step's shardings."""
    import orbax.checkpoint as ocp

    run_dir, saved = saved_run
    asked = []
    restore = ocp.CheckpointManager.restore
    monkeypatch.setattr(ocp.CheckpointManager, "restore", lambda self, step, args=None, **kw: (
        asked.append(args), restore(self, step, args=args, **kw))[1])
    parallel = ParallelConfig(pipe=4, data=2, tensor=1, distributed_optimizer=True)
    mesh, optimizer = make_mesh(parallel, devices), T.make_optimizer(OptimizerConfig(), CFG)
    layout = Layout(replace(CFG, dropout=0.0), parallel, mesh)
    state = rundir.init_state(run_dir, layout, optimizer)
    wanted = T.state_shardings(layout, optimizer)
    read = [jax.tree.leaves(a["state"].item) for a in asked if "state" in a]
    assert len(read) == 1 and len(read[0]) == len(jax.tree.leaves(saved))  # the params, nothing else
    for target, sharding in zip(read[0], jax.tree.leaves(wanted.params)):
        assert target.sharding == sharding
    assert jax.tree.map(lambda x: x.sharding, state) == wanted
    assert int(state.step) == 0
    assert all(not np.asarray(m).any() for m in jax.tree.leaves(state.opt_state) if m.ndim)
    np.testing.assert_array_equal(np.asarray(state.params["layers"]["attn"]["out"]["kernel"]),
                                  saved["layers"]["attn"]["out"]["kernel"])


def test_config_json_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """A signal (Ctrl-C raises while the run starts) or a full disk in the middle of writing config.json leaves the
    one written before, readable, and nothing beside it: it was written in place, and a torn file is a run that
    `--resume` cannot read."""
    import json

    run = RunConfig(model=preset("tiny"), parallel=ParallelConfig(), optimizer=OptimizerConfig(),
                    train=TrainConfig(steps=5, run_dir=str(tmp_path)))
    rundir.write_config(str(tmp_path), run)
    before = (tmp_path / rundir.CONFIG).read_text()
    real_dump = json.dump

    def interrupted(obj, f, **kwargs):
        f.write(json.dumps(obj)[:40])
        f.flush()
        raise KeyboardInterrupt

    monkeypatch.setattr(json, "dump", interrupted)
    with pytest.raises(KeyboardInterrupt):
        rundir.write_config(str(tmp_path), replace(run, train=replace(run.train, steps=9)))
    monkeypatch.setattr(json, "dump", real_dump)
    assert os.listdir(tmp_path) == [rundir.CONFIG] and (tmp_path / rundir.CONFIG).read_text() == before
    assert rundir.saved_configs(str(tmp_path))["train"].steps == 5


def test_the_resume_command_is_whole():
    """What a stopped run prints to continue it: the run directory (quoted for the shell; `--resume` alone resumes
    runs/default), and the launch settings a resume does not restore that this launch gave."""
    run = RunConfig(model=preset("tiny"), parallel=ParallelConfig(), optimizer=OptimizerConfig(),
                    train=TrainConfig(run_dir="runs/my run"))
    assert rundir.resume_command(run) == "python -m jaxseq.train --run-dir 'runs/my run' --resume"
    launch = replace(run.train, run_dir="runs/a", host_devices=4, peak_tflops=312.0)
    assert rundir.resume_command(replace(run, train=launch)) == \
        "python -m jaxseq.train --run-dir runs/a --resume --host-devices 4 --peak-tflops 312"
