"""FSDP (ZeRO-3) and HSDP: an `fsdp` mesh axis that splits every weight's hidden dimension, its gradient and its
optimizer state, each layer gathering its weights inside the layer loop (parallel/fsdp.py).

Against one device (the outside reference: the same model unsplit): the loss and every gradient the step hands to
the optimizer, in six layouts (both families, tensor + SP, HSDP with accumulation with and without the distributed
optimizer, a pipeline, context). From the compiled program: where the gathers and reduce-scatters over `fsdp` run,
what HSDP's distributed optimizer gathers over `data`, and the state bytes per device. Resume across fsdp sizes and
onto a mesh without fsdp; bad input in one line. Float32 (tiny models, 8 devices) but the programs read.
"""

from functools import lru_cache

import jax
import numpy as np
import pytest

from jaxseq.config import ConfigError, OptimizerConfig, ParallelConfig, replace, validate
from jaxseq.presets import preset
from jaxseq.mesh import make_mesh
from jaxseq.models import model as M
from jaxseq.parallel.layout import Layout
from jaxseq.planning import hlo, hlo_collectives, hlo_loops
from jaxseq.planning.memory import state_bytes
from jaxseq.training import aot
from jaxseq.training import train_step as T

from compiled_steps import CompiledStep, counting_batch
from trees import comparable

GPT = replace(preset("tiny"), dtype="float32")  # dropout 0.1: every mask is the global one's rows
LLAMA = replace(preset("tiny-llama"), dtype="float32")
ROWS = 16
# name → (model, layout, micro-batches); the GPT layouts share one reference (their dropout masks depend on m)
LAYOUTS = {
    "fsdp=8 m=2": (GPT, ParallelConfig(fsdp=8), 2),
    "fsdp=4,tensor=2+sp llama": (LLAMA, ParallelConfig(fsdp=4, tensor=2, sequence_parallel=True), 1),
    "data=2,fsdp=2,tensor=2 m=2": (GPT, ParallelConfig(data=2, fsdp=2, tensor=2), 2),
    "data=2,fsdp=2,tensor=2 m=2 distributed optimizer": (
        GPT, ParallelConfig(data=2, fsdp=2, tensor=2, distributed_optimizer=True), 2),
    "pipe=2,fsdp=2,tensor=2+sp m=2": (GPT, ParallelConfig(pipe=2, fsdp=2, tensor=2, sequence_parallel=True), 2),
    "fsdp=2,context=2,tensor=2 ring llama": (LLAMA, ParallelConfig(fsdp=2, context=2, tensor=2,
                                                                    context_strategy="ring"), 1),
}


@lru_cache(maxsize=None)
def gradients(cfg, parallel: ParallelConfig, micro_batches: int):
    """(loss, float32 gradients as numpy) of the step's gradients (`train_step.step_gradients`) on `parallel`."""
    mesh = make_mesh(parallel, jax.devices()[: parallel.num_devices])
    layout = Layout(cfg, parallel, mesh)
    params = jax.device_put(M.init_params(jax.random.key(0), cfg, parallel.tensor), layout.master_shardings)
    fn = jax.jit(T.step_gradients(layout, "selective", micro_batches))
    loss, grads = fn(params, counting_batch(cfg, ROWS, 0), jax.random.key(1))
    return float(loss), jax.tree.map(np.asarray, grads)


FAST = ("fsdp=8 m=2", "fsdp=4,tensor=2+sp llama")  # the fast tier's; the rest compile a region each (slow)


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in LAYOUTS])
def test_loss_and_every_gradient_equal_one_device(devices, name):
    cfg, parallel, micro_batches = LAYOUTS[name]
    loss, grads = gradients(cfg, parallel, micro_batches)
    want_loss, want = gradients(cfg, ParallelConfig(), micro_batches)
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss)
    for (path, got), ref in zip(jax.tree_util.tree_leaves_with_path(comparable(grads)),
                                jax.tree.leaves(comparable(want))):
        scale = np.abs(ref).max()
        assert np.abs(got - ref).max() <= 1e-5 * scale, jax.tree_util.keystr(path)


def test_state_is_split_over_fsdp(devices):
    """Master weights and Adam moments: each weight split over fsdp on its hidden dimension (and over tensor where
    the table says so); a bias or norm scale, which has none, whole."""
    parallel = ParallelConfig(fsdp=4, tensor=2, sequence_parallel=True)
    layout = Layout(GPT, parallel, make_mesh(parallel))
    optimizer = T.make_optimizer(OptimizerConfig(), GPT)
    state = T.init_state(jax.random.key(0), layout, optimizer)
    P = jax.sharding.PartitionSpec
    wi = state.params["layers"]["mlp"]["wi"]["kernel"]  # [L, h, f]
    assert wi.sharding.spec == P(None, "fsdp", "tensor")
    assert wi.addressable_shards[0].data.shape == (GPT.layers, GPT.hidden // 4, GPT.mlp_hidden // 2)
    assert state.params["embed"]["token"].sharding.spec == P("tensor", "fsdp")
    assert state.params["layers"]["ln1"]["scale"].sharding.spec == P(None, None)
    adam = state.opt_state[1][0]
    assert (adam.mu["layers"]["mlp"]["wi"]["kernel"].sharding == wi.sharding
            == adam.nu["layers"]["mlp"]["wi"]["kernel"].sharding)


@pytest.fixture(scope="module")
def bf16_program(devices):
    """(parallel, mesh, the bf16 train step at fsdp=4 × tensor=2 + SP: its optimized HLO, its HLO as partitioned
    (before XLA:CPU promotes bf16 collectives to float32), its compiled memory analysis)."""
    parallel = ParallelConfig(fsdp=4, tensor=2, sequence_parallel=True)
    cfg = replace(GPT, dtype="bfloat16", dropout=0.0)
    mesh = make_mesh(parallel)
    layout = Layout(cfg, parallel, mesh)
    optimizer = T.make_optimizer(OptimizerConfig(), cfg)
    step = T.make_train_step(layout, "selective", optimizer)
    compiled, text = aot.compile_partitioned(step.lower(*aot.abstract_step_inputs(layout, optimizer, ROWS)))
    return parallel, mesh, compiled.as_text(), text, compiled.memory_analysis()


def _fsdp_groups(mesh, axis: str = "fsdp") -> set:
    """The device groups of the `fsdp` axis, or another (ids of devices that differ only in their index on it)."""
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    moved = np.moveaxis(ids, mesh.axis_names.index(axis), -1).reshape(-1, mesh.shape[axis])
    return {tuple(sorted(g)) for g in moved.tolist()}


def _gathered_layer_weights(parallel) -> list[int]:
    """Per-device elements of each layer weight split over fsdp, as a layer uses it (whole over fsdp, split over
    tensor): what each all-gather over fsdp in a layer loop must produce."""
    specs = M.param_specs(GPT, parallel)["layers"]
    shapes = M.param_shapes(GPT, parallel.tensor)["layers"]
    out = []
    for shape, spec in zip(jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)),
                           jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))):
        if "fsdp" in spec:
            out.append(int(np.prod(shape[1:])) // (parallel.tensor if "tensor" in spec else 1))
    return sorted(out)


def test_each_layer_gathers_its_weights_inside_the_loop_and_reduce_scatters_float32(bf16_program):
    """Forward loop: one all-gather over fsdp per layer weight (the six kernels), of one layer's weight. Backward
    loop: the same gathers again (no policy keeps a gathered weight) and one reduce-scatter over fsdp of each
    weight's gradient, in float32 (the partitioned program, before XLA:CPU promotes bf16 collectives). Outside the
    loops nothing over fsdp is gathered but the embedding group (the token and position tables)."""
    parallel, mesh, text, partitioned, _ = bf16_program
    groups = _fsdp_groups(mesh)
    over_fsdp = lambda c: c.groups is not None and {tuple(sorted(g)) for g in c.groups} == groups
    weights = _gathered_layer_weights(parallel)
    assert len(weights) == 6
    forward = [c for c in hlo_collectives.loop_collectives(text, GPT.layers, backward=False) if over_fsdp(c)]
    assert sorted(c.elements for c in forward if c.kind == "all-gather") == weights
    assert [c.kind for c in forward if c.kind != "all-gather"] == []
    backward = [c for c in hlo_collectives.loop_collectives(text, GPT.layers, backward=True) if over_fsdp(c)]
    assert sorted(c.elements for c in backward if c.kind == "all-gather") == weights
    assert sorted(c.elements for c in backward if c.kind == "reduce-scatter") == weights
    in_loops = [r for r in hlo_collectives.reductions(partitioned) if r.in_loop and r.groups and
                {tuple(sorted(g)) for g in r.groups} == groups]
    assert len(in_loops) == 6 and all(r.dtypes == ("f32",) for r in in_loops), in_loops
    tables = {GPT.padded_vocab(2) // 2 * GPT.hidden, GPT.seq_len * GPT.hidden}  # token (split over tensor), position
    outside = [int(np.prod(g.dims)) for g in hlo_collectives.all_gathers(text, parallel.fsdp) if not g.in_loop]
    assert outside and set(outside) <= tables, outside


def test_state_bytes_per_device_are_twelve_bytes_a_parameter_over_fsdp(bf16_program):
    """The compiled step's arguments: the float32 master weights and both Adam moments (12 bytes a parameter)
    split over fsdp (and tensor where split so), plus the parts FSDP leaves whole on every fsdp rank — the
    biases and norm scales, which have no hidden dimension to split — plus the batch, key and step counter.
    The gradients (4 bytes a parameter over fsdp) are the step's temporaries. `plan --fsdp` counts the same
    (`memory.state_bytes`)."""
    parallel, _, _, _, memory = bf16_program
    shapes = M.param_shapes(GPT, parallel.tensor)
    specs = Layout(GPT, parallel).master_specs
    split, whole = 0, 0
    for shape, spec in zip(jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)),
                           jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))):
        n = int(np.prod(shape)) // (parallel.tensor if "tensor" in spec else 1)
        if "fsdp" in spec:
            split += n // parallel.fsdp
        else:
            whole += n
    assert whole < 0.05 * split * parallel.fsdp  # the named parts are small
    batch = 2 * 4 * ROWS // parallel.fsdp * GPT.seq_len  # int32 inputs and targets, rows over fsdp
    extra = memory.argument_size_in_bytes - 12 * (split + whole) - batch
    assert 0 <= extra <= 64, (memory.argument_size_in_bytes, split, whole)  # the key and the step counter
    planned = state_bytes(GPT, parallel.tensor, fsdp=parallel.fsdp)  # `plan --fsdp`'s count
    assert (planned.params + planned.optimizer, planned.gradients) == (12 * (split + whole), 4 * (split + whole))


@pytest.mark.slow
def test_hsdp_with_the_distributed_optimizer_gathers_the_compute_copy_over_data(devices):
    """data=2 × fsdp=2 × tensor=2, bf16, the distributed optimizer: the weights the masters split over `data` are
    gathered over it once a step, each as its compute copy (cast on the master shard first), as without FSDP. In
    the program as partitioned (before XLA:CPU promotes collectives to float32), every all-gather over the data
    groups is bf16 but the norm scales' and biases' (float32, as they compute), and together they move each
    data-split weight's fsdp and tensor shard at its compute dtype's bytes. Left to the partitioner they moved the
    float32 masters (here 111,872 bytes of float32 against these 57,216)."""
    parallel = ParallelConfig(data=2, fsdp=2, tensor=2, distributed_optimizer=True)
    cfg = replace(GPT, dtype="bfloat16", dropout=0.0)
    mesh = make_mesh(parallel)
    layout = Layout(cfg, parallel, mesh)
    optimizer = T.make_optimizer(OptimizerConfig(), cfg)
    step = T.make_train_step(layout, "selective", optimizer)
    _, partitioned = aot.compile_partitioned(step.lower(*aot.abstract_step_inputs(layout, optimizer, ROWS)))
    data = _fsdp_groups(mesh, "data")
    gathered = {"bf16": 0, "f32": 0}  # bytes per device of every all-gather over the data groups
    for instrs in hlo.parse_hlo(partitioned).values():
        for ins in instrs:
            groups = hlo_collectives.replica_groups(ins.rest) or ()
            if ins.opcode == "all-gather" and {tuple(sorted(g)) for g in groups} == data:
                for dtype, dims in ins.arrays():
                    gathered[dtype] = gathered.get(dtype, 0) + hlo.array_bytes(dtype, dims)
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
    leaves = [jax.tree.leaves(layout.param_shapes, is_leaf=lambda x: isinstance(x, tuple)),
              jax.tree.leaves(layout.master_specs, is_leaf=is_spec),
              jax.tree.leaves(layout.param_specs, is_leaf=is_spec), jax.tree.leaves(M.cast_mask(cfg))]
    want = {"bf16": 0, "f32": 0}  # each leaf the masters split over data: its compute shard, whole over data
    for shape, master, compute, cast in zip(*leaves):
        if "data" in master:
            split = np.prod([parallel.fsdp if a == "fsdp" else parallel.tensor for a in compute if a])
            want["bf16" if cast else "f32"] += hlo.array_bytes("bf16" if cast else "f32", shape) // int(split)
    assert want["bf16"] > 10 * want["f32"] > 0
    assert gathered == want


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["dots", "dots_no_batch"])
def test_no_policy_keeps_a_gathered_weight(devices, remat):
    """A layer's stored bytes in the compiled train step at fsdp=8 equal data=8's (each rank b rows either way):
    the gathered weights are not among what a policy keeps. The dot policies are the ones that could (they save
    matmul outputs by JAX's dot rules); the others keep named tensors only, which a gathered weight is not (and
    `test_each_layer_gathers_its_weights_inside_the_loop…` reads `selective`'s backward gathering again)."""
    stored = []
    for parallel in (ParallelConfig(data=8), ParallelConfig(fsdp=8)):
        compiled = aot.compile_train_step(GPT, parallel, remat, make_mesh(parallel), 1)
        stored.append(hlo_loops.stored_bytes_per_layer(compiled.as_text(), GPT.layers))
    assert stored[0] == stored[1] > 0, stored


OPT = T.make_optimizer(OptimizerConfig(lr=3e-3, warmup_steps=0, decay_steps=100), GPT)
STEPS, SAVED_AT = 4, 2


@lru_cache(maxsize=None)
def compiled_step(parallel: ParallelConfig) -> CompiledStep:
    return CompiledStep(GPT, parallel, OPT, 1, 16, jax.random.key(1), SAVED_AT)


@pytest.mark.slow
@pytest.mark.parametrize("onto", [ParallelConfig(fsdp=8), ParallelConfig(data=8)], ids=["fsdp=8", "data=8"])
def test_resume_across_fsdp_sizes(devices, tmp_path, onto):
    """Saved at fsdp=4 × tensor=2, resumed at fsdp=8 and at data=8 without fsdp: the losses of the uninterrupted
    run."""
    saved = compiled_step(ParallelConfig(fsdp=4, tensor=2, sequence_parallel=True))
    straight = saved.run(saved.init(), 0, STEPS, save_to=str(tmp_path))
    assert straight[-1] < straight[0]
    resumed = compiled_step(onto)
    losses = resumed.run(resumed.restore(str(tmp_path)), SAVED_AT, STEPS)
    np.testing.assert_allclose(losses, straight[SAVED_AT:], rtol=1e-5)


@pytest.mark.parametrize("parallel, batch, message", [
    (ParallelConfig(fsdp=8), 16, None),
    (ParallelConfig(fsdp=3, tensor=1), 12, "fsdp=3 does not divide hidden=64"),
    (ParallelConfig(fsdp=8, distributed_optimizer=True), 16, "the distributed optimizer with fsdp=8 and data=1"),
    (ParallelConfig(data=2, fsdp=4), 4, "data×fsdp = 2×4 does not divide batch_size=4"),
    (ParallelConfig(fsdp=0), 16, "fsdp=0 must be a positive integer"),
])
def test_bad_input_is_one_line(parallel, batch, message):
    run = lambda: validate(GPT, parallel, "selective", None, batch)
    if message is None:
        run()
        return
    with pytest.raises(ConfigError, match=message.replace("×", ".")) as e:
        run()
    assert "\n" not in str(e.value)
