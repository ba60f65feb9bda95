"""The jit-compiled train step: sharded state, learning, gradient accumulation."""

import jax
import numpy as np
import optax

from jaxseq.config import OptimizerConfig, ParallelConfig, preset, replace
from jaxseq.mesh import make_mesh
from jaxseq.training import train_step as T

PARALLEL = ParallelConfig(data=2, tensor=4, sequence_parallel=True)


def _batch(cfg, n=8, seed=0):
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (n, cfg.seq_len + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _setup(cfg, micro_batches=1, optimizer=None):
    mesh = make_mesh(PARALLEL)
    optimizer = optimizer or T.make_optimizer(OptimizerConfig(lr=3e-3, warmup_steps=0, decay_steps=100))
    state = T.init_state(jax.random.key(0), cfg, PARALLEL, optimizer, mesh)
    step = T.make_train_step(cfg, PARALLEL, "selective", optimizer, mesh, micro_batches=micro_batches)
    return state, step


def test_state_is_created_in_its_shards():
    cfg = preset("tiny")
    state, _ = _setup(cfg)
    token = state.params["embed"]["token"]
    assert token.addressable_shards[0].data.shape == (cfg.padded_vocab(4) // 4, cfg.hidden)
    mu = state.opt_state[1][0].mu["layers"]["mlp"]["wi"]["kernel"]  # Adam's first moment follows its param
    assert mu.sharding == state.params["layers"]["mlp"]["wi"]["kernel"].sharding


def test_loss_decreases_on_a_repeated_batch():
    cfg = preset("tiny")
    state, step = _setup(cfg)
    batch = _batch(cfg)
    losses = []
    for _ in range(8):
        state, metrics = step(state, batch, jax.random.key(1))
        losses.append(float(metrics["loss"]))
        assert np.isfinite(float(metrics["grad_norm"]))
    assert int(state.step) == 8
    assert losses[-1] < losses[0] - 0.5, losses


def test_gradient_accumulation_equals_the_full_batch():
    cfg = replace(preset("tiny"), dropout=0.0, dtype="float32")
    batch = _batch(cfg)
    results = []
    for micro_batches in (1, 2):
        state, step = _setup(cfg, micro_batches, optax.sgd(1.0))  # the update is then the gradient
        state, metrics = step(state, batch, jax.random.key(1))
        results.append((float(metrics["loss"]), float(metrics["grad_norm"]), jax.device_get(state.params)))
    (loss1, norm1, params1), (loss2, norm2, params2) = results
    assert abs(loss1 - loss2) < 1e-5 and abs(norm1 / norm2 - 1) < 1e-5
    for a, b in zip(jax.tree.leaves(params1), jax.tree.leaves(params2)):
        np.testing.assert_allclose(a, b, atol=1e-6)
