"""Every mesh and every remat policy computes the same loss and gradients as one device, dropout on."""

import jax
import numpy as np
import pytest

from jaxseq.config import ParallelConfig, replace
from jaxseq.presets import preset
from jaxseq.mesh import make_mesh
from jaxseq.models import model as M
from jaxseq.parallel.layout import Layout
from jaxseq.remat import POLICIES
from jaxseq.sharding import Sharder
from jaxseq.training import train_step as T
from trees import comparable

CFG = replace(preset("tiny"), dtype="float32", dropout=0.1)
MESHES = {
    "1x1": ParallelConfig(data=1, tensor=1),
    "data=8": ParallelConfig(data=8, tensor=1),
    "data=2,tensor=4": ParallelConfig(data=2, tensor=4),
    "data=2,tensor=4+sp": ParallelConfig(data=2, tensor=4, sequence_parallel=True),
    "tensor=8+sp": ParallelConfig(data=1, tensor=8, sequence_parallel=True),
}


def _batch(batch_size=8):
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (batch_size, CFG.seq_len + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def loss_and_grads(parallel: ParallelConfig, remat: str):
    # One parameter set for all meshes: padded for the largest tensor size (padding rows are masked).
    params = M.init_params(jax.random.key(1), CFG, tensor=8)
    mesh = make_mesh(parallel, jax.devices()[: parallel.num_devices])
    fn = T.make_loss_and_grad(Layout(CFG, parallel, mesh), remat)
    loss, grads = fn(params, _batch(), jax.random.key(2))
    return float(loss), jax.device_get(grads)


@pytest.fixture(scope="module")
def reference():
    return loss_and_grads(MESHES["1x1"], "none")


def assert_same(result, reference, rtol=1e-5):
    loss, grads = result
    ref_loss, ref_grads = reference
    assert abs(loss - ref_loss) <= rtol * abs(ref_loss)
    grads, ref_grads = comparable(grads), comparable(ref_grads)
    for path, g, r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads),
                          jax.tree.leaves(ref_grads)):
        err = np.max(np.abs(g - r)) / np.max(np.abs(r))
        assert err <= rtol, f"{jax.tree_util.keystr(path[0])}: relative error {err:.2e}"


def test_dropout_is_on(reference):
    """Guard: the comparison would be vacuous if dropout did nothing."""
    params = M.init_params(jax.random.key(1), CFG, tensor=8)
    batch = _batch()
    no_dropout = float(jax.jit(lambda p: M.loss_fn(p, batch, CFG, Sharder(None), "none"))(params))
    assert abs(no_dropout - reference[0]) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", [m for m in MESHES if m != "1x1"])
def test_mesh_matches_single_device(mesh_name, reference):
    assert_same(loss_and_grads(MESHES[mesh_name], "none"), reference)


@pytest.mark.slow
@pytest.mark.parametrize("remat", [p for p in POLICIES if p != "none"])
def test_remat_policy_matches_none(remat, reference):
    assert_same(loss_and_grads(MESHES["data=2,tensor=4+sp"], remat), reference)


def test_fused_attention_matches_explicit_without_dropout():
    cfg = replace(CFG, dropout=0.0)
    params = M.init_params(jax.random.key(1), cfg, tensor=4)
    batch = _batch()
    parallel = ParallelConfig(data=2, tensor=4, sequence_parallel=True)
    mesh = make_mesh(parallel, jax.devices())
    explicit = T.make_loss_and_grad(Layout(cfg, parallel, mesh), "selective")(params, batch, None)
    fused = T.make_loss_and_grad(Layout(replace(cfg, attention="fused"), parallel, mesh),
                                 "selective")(params, batch, None)
    assert_same((float(fused[0]), jax.device_get(fused[1])), (float(explicit[0]), jax.device_get(explicit[1])))
