"""Orbax checkpoints: restore onto another mesh (re-padded vocabulary), fall back past a broken one."""

import logging
import os
import shutil

import jax
import numpy as np
import pytest

from jaxseq import checkpoint as C
from jaxseq import train_step as T
from jaxseq.config import ConfigError, OptimizerConfig, ParallelConfig, preset, replace
from jaxseq.mesh import make_mesh

CFG = replace(preset("tiny"), vocab_size=300, dtype="float32")  # padded to 512 rows at t=4 and t=2, 384 at t=1
OPT = T.make_optimizer(OptimizerConfig())


def _state(parallel, devices, seed=0):
    mesh = make_mesh(parallel, devices)
    return mesh, T.init_state(jax.random.key(seed), CFG, parallel, OPT, mesh)


def _target(parallel, devices):
    mesh = make_mesh(parallel, devices)
    abstract = jax.eval_shape(lambda: T.init_state(jax.random.key(0), CFG, parallel, OPT, mesh))
    return abstract, T.state_shardings(CFG, parallel, OPT, mesh), mesh


def _save(directory, step, state, meta=None):
    mgr = C.manager(directory, keep=3, async_save=True)
    C.save(mgr, step, state, meta or {"data_position": step, "config": {"model": {"layers": 2}}}, force=True)
    mgr.wait_until_finished()
    mgr.close()


def test_restore_on_another_tensor_size_repads_the_vocabulary(devices, tmp_path):
    src = ParallelConfig(2, 4, True)
    _, state = _state(src, devices)
    _save(str(tmp_path), 3, state)
    for dst, used in ((ParallelConfig(4, 2, True), devices), (ParallelConfig(1, 1), devices[:1])):
        abstract, shardings, mesh = _target(dst, used)
        restored, meta = C.restore(C.manager(str(tmp_path)), abstract, shardings, mesh)
        assert meta["data_position"] == 3
        rows = CFG.padded_vocab(dst.tensor)
        assert restored.params["embed"]["token"].shape[0] == rows
        assert restored.params["embed"]["token"].sharding == shardings.params["embed"]["token"]
        # The real vocabulary rows and every other leaf are equal; only padding changed.
        np.testing.assert_array_equal(np.asarray(restored.params["embed"]["token"])[: CFG.vocab_size],
                                      np.asarray(state.params["embed"]["token"])[: CFG.vocab_size])
        for a, b in zip(jax.tree.leaves(restored.params["layers"]), jax.tree.leaves(state.params["layers"])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert int(restored.step) == int(state.step)


def test_unreadable_latest_falls_back_to_the_previous(devices, tmp_path, caplog):
    parallel = ParallelConfig(2, 4, True)
    _, first = _state(parallel, devices, seed=1)
    _, second = _state(parallel, devices, seed=2)
    _save(str(tmp_path), 1, first)
    _save(str(tmp_path), 2, second)
    shutil.rmtree(os.path.join(tmp_path, "2", "state"))  # a damaged newest checkpoint
    abstract, shardings, mesh = _target(parallel, devices)
    with caplog.at_level(logging.WARNING, logger="jaxseq"):
        restored, meta = C.restore(C.manager(str(tmp_path)), abstract, shardings, mesh)
    assert meta["data_position"] == 1
    assert "checkpoint step 2 is unreadable" in caplog.text
    np.testing.assert_array_equal(np.asarray(restored.params["embed"]["token"]),
                                  np.asarray(first.params["embed"]["token"]))


def test_incompatible_model_is_refused():
    C.check_compatible({"layers": 2, "dropout": 0.1}, {"layers": 2, "dropout": 0.0})  # dropout may change
    with pytest.raises(ConfigError, match=r"cannot resume: .*layers=2 \(saved\) vs 3"):
        C.check_compatible({"layers": 2, "hidden": 64}, {"layers": 3, "hidden": 64})
