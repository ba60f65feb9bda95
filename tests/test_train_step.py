"""The jit-compiled train step: sharded state, learning, gradient accumulation."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxseq.config import OptimizerConfig, ParallelConfig, replace
from jaxseq.presets import preset
from jaxseq.mesh import make_mesh
from jaxseq.models import model as M
from jaxseq.training import aot
from jaxseq.training import train_step as T
from jaxseq.parallel.layout import Layout
from test_pipeline import _over_data

PARALLEL = ParallelConfig(data=2, tensor=4, sequence_parallel=True)


def _batch(cfg, n=8, seed=0):
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (n, cfg.seq_len + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _setup(cfg, micro_batches=1, optimizer=None):
    layout = Layout(cfg, PARALLEL, make_mesh(PARALLEL))
    optimizer = optimizer or T.make_optimizer(OptimizerConfig(lr=3e-3, warmup_steps=0, decay_steps=100), cfg)
    state = T.init_state(jax.random.key(0), layout, optimizer)
    step = T.make_train_step(layout, "selective", optimizer, micro_batches=micro_batches)
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



@pytest.mark.slow
def test_gradient_accumulation_with_dropout_is_the_mean_of_the_micro_batches():
    """Each data rank draws its rows of micro-batch i's global dropout masks (key fold_in(key, i)): the
    accumulated gradient is the mean of the micro-batches' gradients computed whole (`make_loss_and_grad`)."""
    cfg, micro_batches = replace(preset("tiny"), dtype="float32"), 4
    assert cfg.dropout > 0
    batch = _batch(cfg, n=16)
    state, step = _setup(cfg, micro_batches, optax.sgd(1.0))  # the update is then the gradient
    before = jax.device_get(state.params)
    loss_and_grad = T.make_loss_and_grad(Layout(cfg, PARALLEL, make_mesh(PARALLEL)), "selective")
    key = jax.random.fold_in(jax.random.key(1), 0)  # the step's key at step 0
    rows = len(batch["inputs"]) // micro_batches
    parts = [loss_and_grad(state.params, {k: v[i * rows:(i + 1) * rows] for k, v in batch.items()},
                           jax.random.fold_in(key, i)) for i in range(micro_batches)]
    state, metrics = step(state, batch, jax.random.key(1))
    assert abs(float(metrics["loss"]) - np.mean([float(loss) for loss, _ in parts])) < 1e-5
    mean_grad = jax.tree.map(lambda *g: np.mean(np.stack(jax.device_get(g)), axis=0), *[g for _, g in parts])
    for b, a, g in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(state.params)),
                       jax.tree.leaves(mean_grad)):
        np.testing.assert_allclose(b - a, g, atol=1e-6 * max(1.0, np.max(np.abs(g))))

# ---------------------------------------------------------------------------------------------
# Gradient accumulation without a pipeline: one data-parallel reduction per step, after the accumulation

ACCUMULATING = {"data=8": ParallelConfig(data=8), "data=4,tensor=2+sp": ParallelConfig(data=4, tensor=2,
                                                                                        sequence_parallel=True)}
MICRO_BATCHES = 4


@pytest.fixture(scope="module")
def accumulating_hlo(devices):
    """(mesh name, distributed optimizer) → the optimized HLO of the train step (tiny model, float32, AdamW,
    4 micro-batches of one row per data rank), compiled once for the module."""
    cfg, texts = replace(preset("tiny"), dtype="float32"), {}

    def compiled(name: str, distributed: bool) -> str:
        if (name, distributed) not in texts:
            parallel = replace(ACCUMULATING[name], distributed_optimizer=distributed)
            mesh = make_mesh(parallel, devices)
            layout = Layout(cfg, parallel, mesh)
            optimizer = T.make_optimizer(OptimizerConfig(), cfg)
            shardings = T.state_shardings(layout, optimizer)
            abstract = jax.eval_shape(lambda: T.init_state(jax.random.key(0), layout, optimizer))
            state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abstract, shardings)
            _, batch = aot.abstract_inputs(layout, parallel.data * MICRO_BATCHES)
            key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, P()))
            step = T.make_train_step(layout, "selective", optimizer, MICRO_BATCHES)
            texts[name, distributed] = step.lower(state, batch, key).compile().as_text()
        return texts[name, distributed]

    return compiled


def _gradient_shapes(cfg, parallel: ParallelConfig, reduce_scattered: bool) -> list[tuple[int, ...]]:
    """Per-device shapes of the gradients the step reduces over `data`: those the distributed optimizer's
    master weights split over `data` (reduce-scattered onto that split) or the others (all-reduced)."""
    sizes = {"tensor": parallel.tensor, "data": parallel.data, None: 1}
    is_spec = lambda x: isinstance(x, P)
    shapes = jax.tree.leaves(M.param_shapes(cfg, parallel.tensor), is_leaf=lambda x: isinstance(x, tuple))
    specs = jax.tree.leaves(Layout(cfg, parallel).master_specs, is_leaf=is_spec)
    return sorted(tuple(n // sizes[axis] for n, axis in zip(shape, [*spec, *[None] * len(shape)]))
                  for shape, spec in zip(shapes, specs) if ("data" in spec) == reduce_scattered)


def _unmatched(reduced: list, expected: list, tensor: int) -> tuple[list, list]:
    """(reduced shapes that are no gradient's, gradient shapes not reduced), pairing each reduced shape with
    one gradient of that shape, or else of that shape with one dimension × tensor: XLA may reduce a gradient
    that is replicated over `tensor` in tensor-split parts (the position embedding's under SP), each rank
    its part, and all-gather it over `tensor` after."""
    def split_of(gradient, shape) -> bool:
        differ = [(a, b) for a, b in zip(gradient, shape) if a != b]
        return len(gradient) == len(shape) and len(differ) == 1 and differ[0][0] == differ[0][1] * tensor

    reduced, expected = list(reduced), list(expected)
    for pairs in (lambda gradient, shape: gradient == shape, split_of):
        for shape in list(reduced):
            match = next((gradient for gradient in expected if pairs(gradient, shape)), None)
            if match is not None:
                expected.remove(match)
                reduced.remove(shape)
    return reduced, expected


# the fast tier keeps the distributed optimizer's (a reduce-scatter onto the master shards); Adam's all-reduce is
# slow-tier
@pytest.mark.parametrize("distributed", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["adam", "distributed-optimizer"])
@pytest.mark.parametrize("name", list(ACCUMULATING))
def test_accumulation_reduces_each_gradient_over_data_once_per_step(accumulating_hlo, name, distributed):
    """As Megatron: each data rank sums its micro-batches' gradients locally and the ranks reduce the sum
    once per step, after the accumulation loop. No reduction inside a loop (the micro-batch scan, the layer
    scans in it) spans two data ranks (one there moves the gradients m times per step), and the reductions
    over the `data` groups after it carry each gradient buffer once (`_unmatched`): all-reduced, or with the
    distributed optimizer reduce-scattered onto its master shard (all-reduced where no dimension splits over
    `data`). Scalars are left out (the loss and the grad-norm's partial sums share those reductions)."""
    cfg, parallel = (replace(preset("tiny"), dtype="float32"),
                     replace(ACCUMULATING[name], distributed_optimizer=distributed))
    in_loop, after = _over_data(accumulating_hlo(name, distributed), 1, parallel.data, parallel.tensor)
    assert not [r.op_name for r in in_loop]
    shapes = lambda kind: [d for r in after if r.kind == kind for d in r.shapes if d]
    assert _unmatched(shapes("all-reduce"), _gradient_shapes(cfg, parallel, reduce_scattered=False),
                      parallel.tensor) == ([], [])
    scattered = _gradient_shapes(cfg, parallel, reduce_scattered=True) if distributed else []
    assert _unmatched(shapes("reduce-scatter"), scattered, parallel.tensor) == ([], [])
