"""The bfloat16 compute path (every GPU preset's default) against the float32 one: same parameters,
batch and dropout key, loss and every gradient within a stated bf16 tolerance, on 1 device and on
data=2 × tensor=4 + SP. Then the weight matmuls' CPU form (`models/cpu_matmul.py`): each against the float32
einsum rounded once, and, read from the compiled step, every one taking bf16 operands.

The tolerance. bfloat16 keeps 8 significant bits: unit roundoff u = 2⁻⁸ ≈ 3.9e-3. Parameters stay
float32 and are cast once; matmuls accumulate in f32; LayerNorm statistics, softmax, GELU and the
cross-entropy compute in f32 (models/ops.py); so the bf16 error is the rounding of each stored activation
and cotangent to bf16 at the op boundaries, ≤ u/2 each. A gradient leaf passes through roughly a
dozen such roundings (embedding, 2 layers × LN/QKV/softmax/context/projection/MLP, their cotangents);
their errors are independent, so a leaf's relative error (‖g_bf16 − g_f32‖ / ‖g_f32‖) is a few u
(measured up to 4.3 u, in the biases, whose gradients are sums with cancellation). Allowed: 8 u = 2⁻⁵.
The loss is the mean over B·s = 512 tokens of f32 log-sum-exps whose bf16 input errors are
independent: its error shrinks like 1/√512 ≈ 1/23 of a token's; allowed u/8 (measured below 1e-5).
What this catches: a bf16 path that differs from the f32 one by more than rounding (a wrong
cast, scale or mask, a term dropped); what it cannot: a precision loss of a few u (LayerNorm statistics
computed in bf16 stay within 8 u at these shapes; test_ops_grad.py checks each op's bf16 gradient to 2⁻⁷).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxseq.config import ParallelConfig, replace
from jaxseq.presets import preset
from jaxseq.mesh import make_mesh
from jaxseq.models import model as M
from jaxseq.models.cpu_matmul import bf16_matmul
from jaxseq.parallel.layout import Layout
from jaxseq.planning import hlo_collectives, hlo_flops
from jaxseq.training import train_step as T
from trees import comparable

U = 2.0**-8  # bfloat16 unit roundoff
GRAD_TOL, LOSS_TOL = 8 * U, U / 8

# vocab 250: padded (to 128·t), as real vocabularies are; dropout on (the masks do not depend on dtype).
CFG = replace(preset("tiny"), vocab_size=250, dropout=0.1, dtype="float32", matmul="cpu-bf16")  # as train runs on CPU


def _batch(batch_size=8):
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (batch_size, CFG.seq_len + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [ParallelConfig(data=1, tensor=1), ParallelConfig(data=2, tensor=4,
                                                                                       sequence_parallel=True)],
                         ids=["1dev", "data2-tensor4-sp"])
def test_bfloat16_step_matches_float32(parallel, devices):
    params = M.init_params(jax.random.key(1), CFG, tensor=4)
    mesh = make_mesh(parallel, devices[: parallel.num_devices])
    out = {}
    for dtype in ("float32", "bfloat16"):
        fn = T.make_loss_and_grad(Layout(replace(CFG, dtype=dtype), parallel, mesh), "selective")
        loss, grads = fn(params, _batch(), jax.random.key(2))
        out[dtype] = float(loss), jax.device_get(grads)
    (loss32, grads32), (loss16, grads16) = out["float32"], out["bfloat16"]
    assert abs(loss16 - loss32) <= LOSS_TOL * abs(loss32), (loss16, loss32)
    worst = 0.0
    grads16, grads32 = comparable(grads16), comparable(grads32)
    for path, g16, g32 in zip(jax.tree_util.tree_leaves_with_path(grads16), jax.tree.leaves(grads16),
                              jax.tree.leaves(grads32)):
        assert g16.dtype == np.float32 and np.isfinite(g16).all()  # gradients of the f32 parameters
        err = np.linalg.norm(g16 - g32) / np.linalg.norm(g32)
        assert err <= GRAD_TOL, f"{jax.tree_util.keystr(path[0])}: relative error {err:.2e} > {GRAD_TOL:.2e}"
        worst = max(worst, err)
    # Guard: the bf16 path really computed in bf16 (else the comparison would be vacuous).
    assert worst > U / 8


@pytest.mark.slow
def test_bfloat16_accumulated_step_matches_float32(devices):
    """The same through the train step's gradient accumulation (2 micro-batches, each data rank summing its
    own float32 gradients before the one reduction over `data`): with SGD at learning rate 1 the update is
    the gradient. (A bf16 step with accumulation first failed to compile here: `data_parallel`.)"""
    import optax

    parallel = ParallelConfig(data=2, tensor=4, sequence_parallel=True)
    mesh = make_mesh(parallel, devices)
    updates = {}
    for dtype in ("float32", "bfloat16"):
        layout = Layout(replace(CFG, dtype=dtype), parallel, mesh)
        state = T.init_state(jax.random.key(1), layout, optax.sgd(1.0))
        before = jax.device_get(state.params)
        step = T.make_train_step(layout, "selective", optax.sgd(1.0), micro_batches=2)
        state, metrics = step(state, _batch(), jax.random.key(2))
        updates[dtype] = float(metrics["loss"]), jax.tree.map(np.subtract, before, jax.device_get(state.params))
    (loss32, grads32), (loss16, grads16) = updates["float32"], updates["bfloat16"]
    assert abs(loss16 - loss32) <= LOSS_TOL * abs(loss32), (loss16, loss32)
    grads16, grads32 = comparable(grads16), comparable(grads32)
    errors = [np.linalg.norm(g16 - g32) / np.linalg.norm(g32) for g16, g32 in zip(jax.tree.leaves(grads16),
                                                                                 jax.tree.leaves(grads32))]
    assert max(errors) <= GRAD_TOL and max(errors) > U / 8, errors

# The weight matmuls as models/gpt.py writes them: QKV, projection, MLP up and down, tied logits.
WEIGHT_MATMULS = [("bsh,hcad->bscad", (2, 16, 32), (32, 3, 2, 8)), ("bsad,adh->bsh", (2, 16, 2, 8), (2, 8, 32)),
                  ("bsh,hf->bsf", (2, 16, 32), (32, 64)), ("bsf,fh->bsh", (2, 16, 64), (64, 32)),
                  ("bsh,vh->bsv", (2, 16, 32), (48, 32))]


@pytest.mark.parametrize("spec,x_shape,w_shape", WEIGHT_MATMULS, ids=[m[0] for m in WEIGHT_MATMULS])
def test_cpu_bf16_matmul_and_its_gradients_are_the_float32_einsum_rounded_once(spec, x_shape, w_shape):
    """Outside reference: jnp.einsum in float32 of the same bf16 values (their products are exact in
    float32). The CPU form's output and both gradients must be that, rounded once to bf16: within the
    unit roundoff u of each element, plus float32 summation-order noise."""
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, x_shape, jnp.bfloat16)
    w = jax.random.normal(kw, w_shape, jnp.bfloat16)
    y, vjp = jax.vjp(lambda x, w: bf16_matmul(spec, x, w), x, w)
    g = jax.random.normal(kg, y.shape, jnp.bfloat16)
    dx, dw = vjp(g)
    f32 = lambda a: np.asarray(a, np.float32)
    y_ref, vjp_ref = jax.vjp(lambda x, w: jnp.einsum(spec, x, w), f32(x), f32(w))
    dx_ref, dw_ref = vjp_ref(f32(g))
    for got, ref in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        assert got.dtype == jnp.bfloat16
        ref = f32(ref)
        np.testing.assert_allclose(f32(got), ref, rtol=U, atol=1e-5 * np.abs(ref).max())


@pytest.mark.slow
def test_cpu_bf16_weight_matmuls_run_in_bf16(devices):
    """XLA:CPU runs a plain bf16 dot by converting its operands to float32; model.matmul hands it bf16
    operands and asks for a float32 result, which it runs natively (twice the float32 rate). Read from
    the compiled step: every weight matmul (forward, replay, both gradients, the logits) takes bf16."""
    parallel = ParallelConfig(data=2, tensor=4, sequence_parallel=True)
    mesh = make_mesh(parallel, devices[: parallel.num_devices])
    cfg = replace(CFG, dtype="bfloat16")
    fn = T.make_loss_and_grad(Layout(cfg, parallel, mesh), "full")
    params = M.init_params(jax.random.key(1), cfg, tensor=4)
    text = fn.lower(params, _batch(), jax.random.key(2)).compile().as_text()
    weight_dots = [d for d in hlo_flops.dots(text) if not d.batched]
    # 5 matmuls forward, 3 replayed under full recompute (not MLP-down), 2 gradients of each of the 5.
    assert len(weight_dots) >= 5 + 3 + 2 * 5, weight_dots
    assert all(d.operands == ("bf16", "bf16") and d.result == "f32" for d in weight_dots), weight_dots


# The train step's gradient paths in bf16, each compiled once for the tests below (its partitioned HLO read too):
# name → (parallel, micro-batches).
PATHS = {
    "data2-tensor4": (ParallelConfig(data=2, tensor=4, sequence_parallel=True), 1),  # no accumulation
    "data2-tensor4-m2": (ParallelConfig(data=2, tensor=4, sequence_parallel=True), 2),  # accumulation
    "data2-context2-tensor2-m2-distopt": (ParallelConfig(data=2, context=2, tensor=2, sequence_parallel=True,
                                                         distributed_optimizer=True), 2),
    "ring-data2-context2-tensor2-distopt": (ParallelConfig(data=2, context=2, tensor=2, sequence_parallel=True,
                                                           context_strategy="ring", distributed_optimizer=True), 1),
    "pipe2-context2-tensor2": (ParallelConfig(pipe=2, context=2, tensor=2, sequence_parallel=True), 2),
    "1f1b-pipe2-data2-tensor2-distopt": (ParallelConfig(pipe=2, data=2, tensor=2, sequence_parallel=True,
                                                        distributed_optimizer=True), 2),
    "data2-fsdp2-tensor2-m2": (ParallelConfig(data=2, fsdp=2, tensor=2, sequence_parallel=True), 2),  # HSDP
    "tensor4-m2": (ParallelConfig(data=1, tensor=4, sequence_parallel=True), 2),  # nothing to reduce over
}
SLOW_PATHS = {"ring-data2-context2-tensor2-distopt", "1f1b-pipe2-data2-tensor2-distopt"}
PATH_PARAMS = [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW_PATHS else []) for name in PATHS
               if name != "tensor4-m2"]


def _received(optimizer):
    """`optimizer` after a transformation that keeps, as its state, the gradients the optimizer received (its
    state starts as the parameters, so that the state's shardings follow theirs), and records their dtypes as
    it is traced."""
    import optax

    dtypes = []

    def update(grads, state, params=None):
        dtypes.extend(str(g.dtype) for g in jax.tree.leaves(grads))
        return grads, grads

    return optax.chain(optax.GradientTransformation(lambda params: params, update), optimizer), dtypes


@pytest.fixture(scope="module")
def bf16_steps(devices):
    """name → (parallel, its bf16 train step compiled, the HLO as partitioned, the dtypes the optimizer was
    traced with, the gradients it received in one step)."""
    from jaxseq.config import OptimizerConfig
    from jaxseq.training import aot

    steps = {}

    def get(name):
        if name not in steps:
            parallel, micro_batches = PATHS[name]
            cfg = replace(CFG, dtype="bfloat16", dropout=0.0)
            mesh = make_mesh(parallel, devices[: parallel.num_devices])
            assert ("context" in mesh.shape) == (parallel.context > 1)
            layout = Layout(cfg, parallel, mesh)
            optimizer, dtypes = _received(T.make_optimizer(OptimizerConfig(), cfg))
            step = T.make_train_step(layout, "selective", optimizer, micro_batches=micro_batches)
            compiled, text = aot.compile_partitioned(step.lower(*aot.abstract_step_inputs(layout, optimizer, 16)))
            state = T.init_state(jax.random.key(1), layout, optimizer)
            state, _ = compiled(state, _batch(16), jax.random.key(2))
            steps[name] = parallel, mesh, text, dtypes, jax.device_get(state.opt_state[0])
        return steps[name]

    return get


@pytest.mark.parametrize("name", ["data2-tensor4-m2", "data2-context2-tensor2-m2-distopt", "pipe2-context2-tensor2",
                                  "tensor4-m2"])
def test_a_bf16_step_with_gradient_accumulation_compiles_on_cpu(bf16_steps, name):
    """The train command's CPU step in bf16 with two micro-batches compiles. XLA:CPU aborted ("Invalid binary
    instruction opcode copy", its bf16 all-reduce promotion) on a mesh holding a size-1 `context` axis
    (`mesh.make_mesh` leaves the axis out), and on the all-gather strategy's reduce-scatter over `context` left
    with `tensor` automatic (`parallel.context._gather_in_region` runs it manual over every axis). On data=1 ×
    tensor=4 the region manual over `data` and `pipe`, both of size 1, made XLA's partitioner refuse its psum
    ("Cross-partition allreduce must be in (partial) manual partitioning mode"): no region there."""
    bf16_steps(name)


@pytest.mark.parametrize("name", PATH_PARAMS)
def test_bf16_gradients_are_reduced_and_applied_in_float32(bf16_steps, name):
    """Megatron's default (--accumulate-allreduce-grads-in-fp32) on every path of a bf16 step (one micro-batch or
    several, a pipeline, context parallelism, the distributed optimizer): each rank's gradients of the bf16
    compute copy are cast to float32, the ranks reduce them in float32 over data (and context), and clipping and
    AdamW receive float32. Read three ways: every floating reduction whose device groups span data or context
    ranks, in the program as XLA's partitioner leaves it (XLA:CPU then promotes bf16 reductions to float32,
    which would hide one), has a float32 element type, except the all-gather strategy's dK/dV reduce-scatter over
    context (activations, within one data rank); the optimizer is traced with float32 gradients; and the
    gradients it receives for each bf16 weight are not all bf16 values (a sum of float32 partial sums is not,
    where a bf16 reduction, or a float32 one cast through bf16 as the pipeline's was, gives only bf16 values)."""
    parallel, mesh, text, dtypes, received = bf16_steps(name)
    coords = {d.id: dict(zip(mesh.axis_names, idx)) for idx, d in np.ndenumerate(mesh.devices)}
    spans = lambda groups, axis: any(len({coords[i].get(axis, 0) for i in g}) > 1 for g in groups)
    batch = lambda groups: spans(groups, "data") or spans(groups, "fsdp")  # ranks of other rows
    over = [r for r in hlo_collectives.reductions(text) if r.groups and (batch(r.groups) or spans(r.groups, "context"))]
    gradient_axes = "data" if parallel.data > 1 else "context"
    reductions = [r for r in over if spans(r.groups, gradient_axes)]
    assert reductions  # the gradients' reductions are there to be read
    assert [(r.kind, r.shapes, r.dtypes, r.op_name) for r in over if set(r.dtypes) != {"f32"}
            and (batch(r.groups) or "reduce_scatter" not in r.op_name)] == []
    if parallel.fsdp > 1:  # the layers' reduce-scatters over fsdp, in the backward loop
        assert [r for r in over if r.in_loop and spans(r.groups, "fsdp")]
    assert dtypes and set(dtypes) == {"float32"}
    cast = jax.tree.leaves(M.cast_mask(replace(CFG, dtype="bfloat16")))
    for (path, g), is_cast in zip(jax.tree_util.tree_leaves_with_path(received), cast):
        g = np.asarray(g)
        assert g.dtype == np.float32
        if is_cast:  # LayerNorm parameters stay float32 anyway
            assert (g != g.astype(jnp.bfloat16).astype(np.float32)).any(), jax.tree_util.keystr(path)
