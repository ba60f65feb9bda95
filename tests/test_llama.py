"""The Llama family trains and samples as GPT does: loss and every gradient (float32, dropout 0 and 0.1) equal
one device's on every mesh, remat policy, pipeline schedule, with the distributed optimizer and with gradient
accumulation; the KV cache gives the window-recomputing tokens; the train command runs it; bad Llama settings
are one line. tiny-llama has 8 query heads sharing 2 K/V heads: tensor=2 splits the K/V heads, tensor=4 and 8
repeat each over 2 and 4 ranks."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxseq.config import ConfigError, ParallelConfig, preset, replace, validate
from jaxseq.mesh import make_mesh
from jaxseq.models import model as M
from jaxseq.parallel import pipeline as PL
from jaxseq.remat import POLICIES
from jaxseq.sharding import Sharder
from jaxseq.training import aot
from jaxseq.training import sampling as S
from jaxseq.training import train_step as T

CFG = replace(preset("tiny-llama"), dtype="float32")
DROPOUTS = (0.0, 0.1)
# name → (mesh, remat policy): K/V heads repeated (tensor=4, 8) or split (tensor=2).
MESHES = {
    "data=2,tensor=4+sp": (ParallelConfig(data=2, tensor=4, sequence_parallel=True), "selective"),
    "tensor=8+sp": (ParallelConfig(data=1, tensor=8, sequence_parallel=True), "full"),
    "data=4,tensor=2": (ParallelConfig(data=4, tensor=2), "none"),
}


def _batch(cfg, n=8, seed=0):
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (n, cfg.seq_len + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _params(cfg=CFG):
    """One parameter set for every mesh: padded for the largest tensor size (padding rows are masked)."""
    return M.init_params(jax.random.key(1), cfg, tensor=8)


def loss_and_grads(parallel: ParallelConfig, remat: str, dropout: float):
    cfg = replace(CFG, dropout=dropout)
    mesh = make_mesh(parallel, jax.devices()[: parallel.num_devices])
    loss, grads = T.make_loss_and_grad(cfg, parallel, remat, mesh)(_params(), _batch(cfg), jax.random.key(2))
    return float(loss), jax.device_get(grads)


@pytest.fixture(scope="module")
def reference(devices):
    """dropout → (loss, grads) on one device, remat none; each computed once for the module."""
    cache = {}

    def get(dropout):
        if dropout not in cache:
            cache[dropout] = loss_and_grads(ParallelConfig(), "none", dropout)
        return cache[dropout]

    return get


def assert_same(result, reference, rtol=1e-5):
    """test_parallel's tolerance: the loss, and every gradient relative to its largest entry."""
    loss, grads = result
    ref_loss, ref_grads = reference
    assert abs(loss - ref_loss) <= rtol * abs(ref_loss), (loss, ref_loss)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        scale = np.max(np.abs(r))
        assert scale > 0, jax.tree_util.keystr(path)  # every parameter gets a gradient
        err = np.max(np.abs(np.asarray(g) - r)) / scale
        assert err <= rtol, f"{jax.tree_util.keystr(path)}: relative error {err:.2e}"


def test_kv_heads_split_over_tensor_or_repeated():
    """tensor=2 divides the 2 K/V heads: the kernel splits over `tensor`; tensor=4 is a multiple of them: the
    kernel is whole on every rank (each takes its head's slice), and the sampling cache holds 4 heads."""
    spec = lambda t: M.param_specs(CFG, ParallelConfig(tensor=t))["layers"]["attn"]["kv"]["kernel"]
    assert spec(2) == P(None, None, None, "tensor", None)
    assert "tensor" not in jax.tree.leaves(tuple(spec(4))) and "tensor" not in jax.tree.leaves(tuple(spec(8)))
    assert M.family(CFG).cache_heads(CFG, 4) == 4 and M.family(CFG).cache_heads(CFG, 2) == 2


def test_dropout_is_on(reference):
    """Guard: the dropout 0.1 comparisons would be vacuous if dropout did nothing."""
    assert abs(reference(0.1)[0] - reference(0.0)[0]) > 1e-4


def _cases(names, fast):
    """(name, dropout) for every name and dropout, slow except `fast`."""
    return [pytest.param(n, d, id=f"{n}-dropout={d}", marks=() if (n, d) == fast else pytest.mark.slow)
            for n in names for d in DROPOUTS]


# The fast tier keeps the repeated-K/V mesh with dropout.
@pytest.mark.parametrize("mesh_name,dropout", _cases(MESHES, ("data=2,tensor=4+sp", 0.1)))
def test_mesh_matches_single_device(mesh_name, dropout, reference):
    parallel, remat = MESHES[mesh_name]
    assert_same(loss_and_grads(parallel, remat, dropout), reference(dropout))
