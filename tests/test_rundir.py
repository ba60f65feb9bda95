"""The run directory's placement of restored weights onto a training mesh (`training/rundir.place`)."""

import jax
import numpy as np
import pytest

from jaxseq.config import ParallelConfig, preset
from jaxseq.mesh import make_mesh
from jaxseq.models import gpt as M
from jaxseq.training import rundir


@pytest.mark.parametrize("parallel", [ParallelConfig(pipe=2, data=2, tensor=2, sequence_parallel=True),
                                      ParallelConfig(pipe=2, data=1, tensor=4)], ids=["p2d2t2sp", "p2t4"])
def test_place_shards_layers_over_pipe_as_the_train_step_does(parallel, devices):
    """The layers land split over `pipe` (the train step's specs for this mesh), each device holding 1/(p·t)
    of a tensor-split layer weight; the values are the host copy's. Before, `place` built its ParallelConfig
    by position, so the pipe size landed in `distributed_optimizer` and the layers were replicated."""
    cfg = preset("tiny")
    host = jax.tree.map(np.asarray, M.init_params(jax.random.key(0), cfg, 1))
    placed = rundir.place(host, cfg, make_mesh(parallel, devices), parallel.sequence_parallel)
    for leaf, spec in zip(jax.tree.leaves(placed), jax.tree.leaves(M.param_specs(parallel))):
        assert leaf.sharding.spec == spec
    kernel = placed["layers"]["mlp"]["wi"]["kernel"]  # [L, h, f]: layers over pipe, f over tensor
    assert kernel.addressable_shards[0].data.size == kernel.size // (parallel.pipe * parallel.tensor)
    np.testing.assert_array_equal(np.asarray(kernel), host["layers"]["mlp"]["wi"]["kernel"])
