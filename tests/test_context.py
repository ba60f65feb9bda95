"""Context parallelism (parallel/context.py): the same loss and gradients as context=1 for both strategies,
the collectives and stored bytes the compiled program shows, the load balance, and bad input in one line."""

import json
import os
import shutil
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from commands import command
from jaxseq import generate as generate_command
from jaxseq import train as train_command
from jaxseq.config import ConfigError, OptimizerConfig, ParallelConfig, replace, validate, validate_parallel
from jaxseq.presets import preset
from jaxseq.mesh import make_mesh, parse_mesh
from jaxseq.models import model as M
from jaxseq.parallel.context import DIAG, EMPTY, FULL, attention_work, ring_plan, same_context_permutes
from jaxseq.planning import hlo, hlo_collectives, hlo_flops, hlo_loops
from jaxseq.sharding import Sharder, context_chunks, context_order, entry_axes, stored_positions
from jaxseq.training import aot
from jaxseq.training import loop, rundir
from jaxseq.training import train_step as T
from jaxseq.parallel import data_parallel as DP
from jaxseq.parallel import pipeline as PL
from jaxseq.planning.stash import stash_layout
from jaxseq.parallel.layout import Layout
from trees import comparable

GPT = replace(preset("tiny"), dtype="float32", dropout=0.1)
LLAMA = replace(preset("tiny-llama"), dtype="float32")  # 8 query heads sharing 2 K/V heads


def _batch(cfg, batch_size=8):
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def loss_and_grads(cfg, parallel: ParallelConfig, remat: str):
    validate(cfg, parallel, remat, parallel.num_devices)
    params = M.init_params(jax.random.key(1), cfg, tensor=8)
    layout = Layout(cfg, parallel, make_mesh(parallel, jax.devices()[: parallel.num_devices]))
    loss, grads = T.make_loss_and_grad(layout, remat)(params, _batch(cfg), jax.random.key(2))
    return float(loss), jax.device_get(grads)


def context_mesh(c: int, strategy: str) -> ParallelConfig:
    return ParallelConfig(data=8 // (2 * c), context=c, tensor=2, sequence_parallel=True, context_strategy=strategy)


@pytest.fixture(scope="module")
def gpt_reference():
    return loss_and_grads(GPT, ParallelConfig(data=4, tensor=2, sequence_parallel=True), "none")


@pytest.fixture(scope="module")
def llama_reference():
    return loss_and_grads(LLAMA, ParallelConfig(data=4, tensor=2, sequence_parallel=True), "none")


def assert_same(result, reference, rtol=1e-5):
    loss, grads = result
    ref_loss, ref_grads = reference
    assert abs(loss - ref_loss) <= rtol * abs(ref_loss), (loss, ref_loss)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(comparable(grads)),
                            jax.tree.leaves(comparable(ref_grads))):
        err = np.max(np.abs(g - r)) / np.max(np.abs(r))
        assert err <= rtol, f"{jax.tree_util.keystr(path)}: relative error {err:.2e}"


@pytest.mark.parametrize("c,strategy", [  # the ring at c = 4 in the slow tier (11 s of compiles)
    (2, "all-gather"), (2, "ring"), (4, "all-gather"), pytest.param(4, "ring", marks=pytest.mark.slow)])
def test_gpt_with_dropout_equals_context_1(strategy, c, gpt_reference):
    """tensor=2 + SP, dropout on (every mask drawn at its token's global position), selective recompute."""
    assert_same(loss_and_grads(GPT, context_mesh(c, strategy), "selective"), gpt_reference)


@pytest.mark.parametrize("strategy,c", [  # the ring at c = 2 in the slow tier: pairwise, below
    ("all-gather", 2), pytest.param("ring", 2, marks=pytest.mark.slow), ("ring", 4)])
def test_llama_grouped_query_attention_equals_context_1(strategy, c, llama_reference):
    """RoPE at the reordered global positions; only the K/V heads travel. The fast tier holds the ring pairwise:
    grouped-query attention under the ring at c = 4 (here: the same kinds of ring step as at c = 2, the local
    diagonal block and half blocks, more of them), the ring at c = 2 with GPT (test_gpt_with_dropout_equals_context_1
    [2-ring])."""
    assert_same(loss_and_grads(LLAMA, context_mesh(c, strategy), "none"), llama_reference)


def test_fused_attention_under_all_gather_equals_context_1(llama_reference):
    """The fused implementation with the dense mask of global positions (the 2c-chunk order is no triangle)."""
    assert_same(loss_and_grads(replace(LLAMA, attention="fused"), context_mesh(2, "all-gather"), "none"),
                llama_reference)


@pytest.mark.slow  # the fast tier holds the ring against context 1 (test_gpt_with_dropout_equals_context_1)
def test_the_rings_products_take_bf16_and_accumulate_in_float32(gpt_reference):
    """FlashAttention-2's precision, which explicit attention's matches (it casts its probabilities to the model's
    dtype before scores × V): in a bf16 model every product of the ring's blocks (QKᵀ and P·V; the backward's
    QKᵀ again, dP, dQ, dK and dV) takes bf16 operands and gives a float32 result: on a GPU bf16 tensor cores,
    where float32 operands run as TF32 at half their rate (before, 5 of the 7 took float32). The ring's loss
    and gradients stay as close to the float32 reference as the whole-sequence attention's in bf16 are."""
    cfg = replace(GPT, dtype="bfloat16")
    params = M.init_params(jax.random.key(1), cfg, tensor=8)

    def run(parallel):
        layout = Layout(cfg, parallel, make_mesh(parallel, jax.devices()[: parallel.num_devices]))
        compiled = T.make_loss_and_grad(layout, "selective").lower(params, _batch(cfg), jax.random.key(2)).compile()
        loss, grads = compiled(params, _batch(cfg), jax.random.key(2))
        errors = [np.max(np.abs(np.asarray(g, np.float32) - r)) / np.max(np.abs(r))
                  for g, r in zip(jax.tree.leaves(comparable(jax.device_get(grads))),
                                  jax.tree.leaves(comparable(gpt_reference[1])))]
        return abs(float(loss) - gpt_reference[0]) / abs(gpt_reference[0]), max(errors), compiled.as_text()

    ring_loss, ring_grads, text = run(context_mesh(2, "ring"))
    whole_loss, whole_grads, _ = run(ParallelConfig(data=4, tensor=2, sequence_parallel=True))
    blocks = [d for d in hlo_flops.dots(text) if d.batched]  # the weights' products are unbatched
    assert len(blocks) >= 7, blocks
    assert all(d.operands == ("bf16", "bf16") and d.result == "f32" for d in blocks), blocks
    assert ring_loss <= 1e-4 and ring_grads <= 1.1 * whole_grads, (ring_loss, ring_grads, whole_grads)


@pytest.mark.slow  # the fast tier holds the ring against context 1 (test_gpt_with_dropout_equals_context_1)
def test_the_ring_computes_a_blocks_query_rows_a_tile_at_a_time(gpt_reference, monkeypatch):
    """A ring block's query rows run `context.QUERY_TILE` at a time (a scan), so one tile's float32 scores are
    alive, not the block's (s/2c)². Tiled (4 tiles of 4 rows at s = 64, c = 2, or 2 of 8) the ring equals
    context 1, dropout included; at s = 2048 (blocks of 512², 8 MiB of scores each) tiles of 128 rows take the step's
    transient from 63.7 MiB to 19.4 MiB on XLA:CPU (jax 0.10; on the H100's program at s = 16384 tiles of 1024 rows take
    it from 4,652 to 497 MiB), and with dropout from 112.2 to 26.2 MiB. The dropout counters and the causal mask are the
    same in every layer, and JAX's partial evaluation of the layer scan had moved them out of it, made for every tile of
    a block at once (stacked [tiles, …] arrays): with dropout the tiled step held 112.5 MiB (171.2 untiled); they are
    made in the loop now (`ops.bernoulli_at`, `_Blocks.scores`). Both tiled steps are held under 4 blocks' scores
    (32 MiB), and the untiled one (without dropout) at least that far above its tiled one; the untiled step with
    dropout is not compiled (6 s): the tiled step's bound alone fails where the hoisted counters were (112.5 MiB)."""
    from jaxseq.parallel import context as CTX

    for rows in (4, 8):  # a scan of 4 tiles; 2 tiles, straight-line code
        monkeypatch.setattr(CTX, "QUERY_TILE", rows)
        assert_same(loss_and_grads(GPT, context_mesh(2, "ring"), "selective"), gpt_reference)
    parallel = ParallelConfig(data=1, context=2, tensor=1, context_strategy="ring")
    mesh = make_mesh(parallel, jax.devices()[:2])
    for dropout, tiles in ((0.0, (128, 1 << 20)), (0.1, (128,))):  # untiled: without dropout only
        cfg = replace(GPT, seq_len=2048, dtype="bfloat16", dropout=dropout)
        temp = {}
        for rows in tiles:
            monkeypatch.setattr(CTX, "QUERY_TILE", rows)
            temp[rows] = aot.compile_loss_and_grad(
                cfg, parallel, "selective", mesh, 1).memory_analysis().temp_size_in_bytes
        block_scores = cfg.heads * 512 * 512 * 4
        assert temp[128] < 4 * block_scores, (dropout, temp)
        if 1 << 20 in temp:
            assert temp[128] < temp[1 << 20] - 4 * block_scores, (dropout, temp)


def accumulated(cfg, parallel: ParallelConfig, remat: str, microbatches: int = 2):
    """(loss, grads) of the gradient-accumulating step's computation (the pipeline's with pipe > 1)."""
    validate(cfg, parallel, remat, parallel.num_devices, batch_size=8, micro_batch_size=8 // microbatches)
    params = M.init_params(jax.random.key(1), cfg, tensor=8)
    mesh = make_mesh(parallel, jax.devices()[: parallel.num_devices])
    layout = Layout(cfg, parallel, mesh)
    if parallel.pipe > 1:
        fn = PL.make_loss_and_grad(layout, remat, microbatches)
    else:
        fn = jax.jit(partial(DP.accumulate_loss_and_grad, layout=layout, remat=remat, microbatches=microbatches,
                             grad_specs=layout.param_specs),
                     out_shardings=(None, layout.param_shardings))
    with jax.set_mesh(mesh):
        loss, grads = fn(params, _batch(cfg), jax.random.key(2))
    return float(loss), jax.device_get(grads)


GPT4 = replace(GPT, layers=4)  # pipe=2 × 2 virtual stages: one layer a chunk


def accumulated_model(strategy: str):
    """GPT4 for all-gather; for the ring without dropout (pairwise: dropout is most of a ring program's compile, and
    the ring's dropout is held against context 1 by test_gpt_with_dropout_equals_context_1 and the tile test)."""
    return GPT4 if strategy == "all-gather" else replace(GPT4, dropout=0.0)


@pytest.fixture(scope="module")
def accumulated_reference():
    """Two micro-batches at context 1 (each draws its dropout masks from its own key), 4 layers: the reference of
    the accumulating runs below and of the pipelined ones (one compile for both; the layers are a scan, their
    number no part of what either compares). → get(cfg): GPT4's, or without dropout the ring's (`accumulated_model`),
    each compiled once when first asked for."""
    done = {}

    def get(cfg):
        if cfg.dropout not in done:
            done[cfg.dropout] = accumulated(cfg, ParallelConfig(data=4, tensor=2, sequence_parallel=True), "none")
        return done[cfg.dropout]

    return get


# Slow (9 s, all-gather with dropout): the fast tier's pipelined run below accumulates micro-batches at context 2
# against the same reference, and test_accumulation_reduces_… reads the accumulation's one reduction.
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["all-gather", "ring"])
def test_gradient_accumulation_equals_context_1(strategy, accumulated_reference):
    """The accumulation's region is manual over data × context: each rank runs its tokens of its rows, sums
    its gradients over the micro-batches and the ranks reduce them once (the ring included). Dropout on with
    all-gather (each micro-batch's masks from its own key); the ring's run without (`accumulated_model`: pairwise,
    its compile 10 s with dropout, 3 s without)."""
    cfg = accumulated_model(strategy)
    assert_same(accumulated(cfg, context_mesh(2, strategy), "selective"), accumulated_reference(cfg))


@pytest.mark.parametrize("schedule,virtual,strategy", [  # the fast tier keeps 1F1B with all-gather (9 s)
    ("1f1b", 1, "all-gather"), pytest.param("interleaved", 2, "all-gather", marks=pytest.mark.slow),
    pytest.param("interleaved", 2, "ring", marks=pytest.mark.slow),
    pytest.param("zb-h1", 1, "ring", marks=pytest.mark.slow)])
def test_a_pipelined_run_equals_context_1(schedule, virtual, strategy, accumulated_reference):
    """pipe=2 × context=2 × tensor=2 + SP, both strategies: the executor's region is manual over
    context too, each stage passing one context rank's activations to the next. The ring's sends run inside
    the ticks' branches, every branch padded to the same count of context permutes
    (`context.same_context_permutes`; under zb-h1 its W branch, which has none, too). Pairwise: the ring under
    interleaving (F and B branches of each of two chunks) and under ZB-H1 (F, B and W), not also under 1F1B, whose
    ticks are interleaving's at one chunk (56 s of ring compiles). Dropout on (each micro-batch's masks from its own
    key, in every stage) but for the ring under ZB-H1 (`accumulated_model`): the ring's masks inside a pipeline's
    stages are held by the interleaved row, dropout under ZB-H1 by tests/test_pipeline.py's (with it the ZB-H1 ring
    run took 27 s, without 10 s)."""
    parallel = ParallelConfig(pipe=2, context=2, tensor=2, sequence_parallel=True, schedule=schedule,
                              virtual_stages=virtual, context_strategy=strategy)
    cfg = GPT4 if schedule == "interleaved" else accumulated_model(strategy)
    assert_same(accumulated(cfg, parallel, "selective"), accumulated_reference(cfg))


@pytest.mark.parametrize("strategy", ["ring", pytest.param("all-gather", marks=pytest.mark.slow)])  # ring: 6 s
def test_a_pipelined_evaluation_equals_the_unpipelined_loss(strategy):
    """The evaluation of a pipelined run at context 2 (the forward-only schedule, `tick_programs.ForwardProgram`),
    each stage's branch padded to the ring's permutes as the training ticks are (one tick skeleton, `run_tick`):
    the unpipelined model's loss on one device. Its ring once named a function that no longer existed."""
    cfg = replace(GPT4, dropout=0.0)
    parallel = ParallelConfig(pipe=2, context=2, tensor=2, sequence_parallel=True, context_strategy=strategy)
    params, batch = M.init_params(jax.random.key(1), cfg), _batch(cfg)
    layout = Layout(cfg, parallel, make_mesh(parallel, jax.devices()[:parallel.num_devices]))
    placed = jax.device_put(params, layout.master_shardings)
    expected = float(M.loss_fn(params, batch, cfg, Sharder(None, False), "none"))
    assert float(loop.make_eval_fn(layout, 2)(placed, batch)) == pytest.approx(expected, rel=1e-6)


def test_a_pipeline_stashes_one_context_ranks_tokens():
    """What a pipelined micro-batch chunk keeps between its forward and backward at context 2 is half of
    context 1's, every leaf per token (no full-sequence K/V, no position table kept as a constant)."""
    def slot_bytes(context: int):
        parallel = ParallelConfig(pipe=2, context=context, tensor=2, sequence_parallel=True)
        mesh = make_mesh(parallel, jax.devices()[: parallel.num_devices])
        stash, _ = stash_layout(Layout(GPT, parallel, mesh), "selective", 2, 2)
        assert all(a.shape[2] == GPT.seq_len // context for a in stash), [a.shape for a in stash]  # [k, b, s/c, …]
        return sum(a.size * a.dtype.itemsize for a in stash)
    assert slot_bytes(2) * 2 == slot_bytes(1)


def test_dropout_is_on(gpt_reference):
    """Guard: the dropout comparison would be vacuous if dropout did nothing. The same step without dropout on the
    reference's own mesh (a context run that dropped its masks would differ from the reference in the tests
    above, so the mesh it is told apart on is the reference's)."""
    assert abs(loss_and_grads(replace(GPT, dropout=0.0), ParallelConfig(data=4, tensor=2, sequence_parallel=True),
                              "none")[0] - gpt_reference[0]) > 1e-4


# ---------------------------------------------------------------------------------------------
# The layout and the load balance


def test_the_two_chunk_order():
    assert context_chunks(2) == ((0, 3), (1, 2))
    np.testing.assert_array_equal(context_order(16, 2), [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])


@pytest.mark.parametrize("c", [2, 4, 8])
def test_computed_positions_are_the_chunk_order(c):
    """`stored_positions` (what a region manual over `context` computes from its rank) is `context_order`."""
    s = 64
    np.testing.assert_array_equal(stored_positions(jnp.arange(s), s, c), context_order(s, c))
    for r in range(c):
        np.testing.assert_array_equal(stored_positions(r * (s // c) + jnp.arange(s // c), s, c),
                                      context_order(s, c)[r * s // c:(r + 1) * s // c])


@pytest.mark.parametrize("c", [2, 4, 8])
def test_ring_work_is_equal_per_rank_with_the_reorder_and_unequal_without(c):
    """Blocks of (s/2c)² scores each rank's ring computes (the plan its switch branches are built from)."""
    assert attention_work(context_chunks(c)) == [2 * c + 1] * c
    contiguous = tuple((2 * r, 2 * r + 1) for r in range(c))
    assert attention_work(contiguous) == [4 * r + 3 for r in range(c)]  # the last rank 4c−1 vs 3


def test_every_ring_step_is_a_diagonal_or_half_a_block():
    """With the 2c-chunk order a step is the causal local block (step 0) or exactly half a block."""
    for rank in ring_plan(context_chunks(4)):
        assert rank[0] == ((DIAG, EMPTY), (FULL, DIAG))
        for step in rank[1:]:
            assert step in (((FULL, EMPTY), (FULL, EMPTY)), ((EMPTY, EMPTY), (FULL, FULL)))


# ---------------------------------------------------------------------------------------------
# The compiled program: collectives over `context` and stored bytes


def _groups(mesh, *axes: str) -> set[tuple[int, ...]]:
    """The device groups spanning `axes` of the mesh, the other axes fixed (sorted device ids)."""
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    names = list(mesh.axis_names)
    moved = np.moveaxis(ids, [names.index(a) for a in axes], range(-len(axes), 0))
    return {tuple(sorted(g)) for g in moved.reshape(-1, int(np.prod([mesh.shape[a] for a in axes]))).tolist()}


def _loop_collectives(text: str, backward: bool, groups) -> list[tuple[str, tuple[int, ...]]]:
    """(kind, dims) of every collective one layer-loop iteration runs over the given device groups
    (collective-permutes, which name pairs rather than groups, are all counted)."""
    comps = hlo.parse_hlo(text)
    (loop,) = [l for l in hlo_loops.layer_loops(comps, GPT.layers) if l.backward == backward]
    found = []
    for comp in hlo.called_computations(comps, loop.body):
        for ins in comps[comp]:
            kind = ins.opcode.removesuffix("-start")
            if kind == "collective-permute" or (
                    kind in hlo.COLLECTIVES
                    and {tuple(sorted(g)) for g in hlo_collectives.replica_groups(ins.rest) or []} == groups):
                found += [(kind, dims) for _, dims in ins.arrays()]
    return found


@pytest.fixture(scope="module")
def compiled():
    """The selective-recompute loss-and-gradient program at context 1 and 2 (both strategies): its HLO text."""
    def text(parallel):
        mesh = make_mesh(parallel, jax.devices()[:parallel.num_devices])
        return aot.compile_loss_and_grad(GPT, parallel, "selective", mesh, 4).as_text()
    base = dict(data=2, tensor=2, sequence_parallel=True)
    return {"1": text(ParallelConfig(**base)),
            "all-gather": text(ParallelConfig(**base, context=2)),
            "ring": text(ParallelConfig(**base, context=2, context_strategy="ring"))}


B, S, HEADS, D = 2, GPT.seq_len, GPT.heads // 2, GPT.head_dim  # per device: 4 rows over data=2, heads over t=2
CONTEXT_GROUPS = _groups(make_mesh(ParallelConfig(data=2, context=2, tensor=2)), "context")


def test_all_gather_gathers_only_k_and_v_over_context(compiled):
    kv = ("all-gather", (B, S, HEADS, D))
    forward = _loop_collectives(compiled["all-gather"], False, CONTEXT_GROUPS)
    assert forward == [kv, kv]  # nothing else over context, nothing else of full length
    backward = _loop_collectives(compiled["all-gather"], True, CONTEXT_GROUPS)
    assert [c for c in backward if c[0] == "all-gather"] == [kv, kv]  # gathered again, not stored


def test_ring_has_no_all_gather_over_context_only_the_rings_permutes(compiled):
    c = 2
    for backward in (False, True):
        found = _loop_collectives(compiled["ring"], backward, CONTEXT_GROUPS)
        assert not [x for x in found if x[0] == "all-gather"]
        permutes = [x for x in found if x[0] == "collective-permute"]
        # forward: K and V c−1 times; backward: K and V c−1 times, dK and dV c times (back to their owners)
        assert len(permutes) == (2 * (c - 1) if not backward else 2 * (c - 1) + 2 * c)
    assert not [g for g in hlo_collectives.all_gathers(compiled["ring"], 2) if g.dims[1:2] == (S,) and len(g.dims) == 4]


def test_stored_bytes_divide_by_context(compiled):
    """Every stored tensor is per token: context=2 stores half of context=1's, and no full-length K/V. The ring
    keeps its log-sum-exp as its backward's residual beside its output, which is the context the projection keeps
    (tagged once, inside its forward rule: before, a second tagged copy of it was stored too)."""
    per_layer = {name: hlo_loops.stored_bytes_per_layer(text, GPT.layers) for name, text in compiled.items()}
    assert per_layer["all-gather"] * 2 == per_layer["1"]
    lse = B * HEADS * (S // 2) * 4
    assert per_layer["ring"] == per_layer["1"] // 2 + lse


def _shards(shape, spec, sizes) -> tuple[int, ...]:
    """A tensor's per-device shape under `spec` (entries naming one axis or several)."""
    return tuple(n // int(np.prod([sizes[a] for a in entry_axes(e)]))
                 for n, e in zip(shape, [*spec, *[None] * len(shape)]))


def test_accumulation_reduces_gradients_over_data_and_context_once_onto_their_shards():
    """Megatron's: the context ranks are data ranks to the weights. With gradient accumulation (the ring, the
    distributed optimizer) no reduction inside a loop spans two data or context ranks, and after the loop the
    gradients are reduce-scattered over data × context onto the master shards, which split over both. Without
    dropout (most of a ring step's compile: 8 s with it, 5 s without): every mask is drawn on its own device at its
    tokens' positions (`ops.dropout`), no collective, and the reductions read here are the gradients'."""
    cfg = replace(GPT, dropout=0.0)
    parallel = ParallelConfig(data=2, context=2, tensor=2, sequence_parallel=True, context_strategy="ring",
                              distributed_optimizer=True)
    mesh = make_mesh(parallel, jax.devices())
    layout = Layout(cfg, parallel, mesh)
    optimizer = T.make_optimizer(OptimizerConfig(), cfg)
    shardings = T.state_shardings(layout, optimizer)
    abstract = jax.eval_shape(lambda: T.init_state(jax.random.key(0), layout, optimizer))
    state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abstract, shardings)
    _, batch = aot.abstract_inputs(layout, 8)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, P()))
    text = T.make_train_step(layout, "selective", optimizer, 2).lower(state, batch, key).compile().as_text()

    coords = {d.id: dict(zip(mesh.axis_names, idx)) for idx, d in np.ndenumerate(mesh.devices)}
    spans = lambda g, axis: len({coords[i][axis] for i in g}) > 1
    reductions = hlo_collectives.reductions(text)
    assert not [r.op_name for r in reductions if r.in_loop and (r.groups is None or any(
        spans(g, "data") or spans(g, "context") for g in r.groups))]
    data_context = _groups(mesh, "data", "context")
    after = [r for r in reductions
             if not r.in_loop and r.groups and {tuple(sorted(g)) for g in r.groups} == data_context]
    sizes = {"data": 2, "context": 2, "tensor": 2}
    specs = jax.tree.leaves(layout.master_specs, is_leaf=lambda x: isinstance(x, P))
    shapes = jax.tree.leaves(M.param_shapes(cfg, parallel.tensor), is_leaf=lambda x: isinstance(x, tuple))
    split = [_shards(shape, spec, sizes) for shape, spec in zip(shapes, specs)
             if any(entry_axes(e) == ("data", "context") for e in spec)]
    assert len(split) == len(specs) - 1  # every leaf but one has a dimension d·c = 4 divides
    scattered = sorted(d for r in after if r.kind == "reduce-scatter" for d in r.shapes if d)
    assert scattered == sorted(split)  # each gradient once, onto its 1/(d·c) shard


# ---------------------------------------------------------------------------------------------
# The training command, and bad input

BASE = ["--preset", "tiny", "--dtype", "float32", "--batch-size", "8", "--host-devices", "8", "--log-every", "1",
        "--eval-every", "3", "--warmup-steps", "2", "eval_batches=1", "sample_tokens=4"]
TINY = BASE + ["--steps", "3"]
RUN = BASE + ["dropout=0.0", "decay_steps=3", "--checkpoint-every", "3"]  # the runs below and their resume


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if "run" not in r]  # not the closing time record


@pytest.fixture(scope="module")
def context_runs(tmp_path_factory):
    """The train command's runs the two tests below read, each run once for the module when first asked for
    (dropout off): "1", data=4,tensor=2 for 5 steps (the reference of both); "all-gather", 3 steps (checkpointed at
    step 3, where the second test resumes it at context 1); "ring", with gradient accumulation and the distributed
    optimizer (master shards split over data × context). Pipelined layouts with context run as the command in
    test_layouts.py. The cosine ends at step 3 in every run (decay_steps=3), so the reference's first 3 steps are a
    3-step run's. Only the ring's run draws the end-of-run sample (sampling from a context-parallel run's weights);
    the others compile no sampler. → get(name): (its run directory, what the command printed)."""
    tmp = tmp_path_factory.mktemp("context-runs")
    runs = {"1": ["--steps", "5", "--mesh", "data=4,tensor=2", "sample_tokens=0"],
            "all-gather": ["--steps", "3", "--mesh", "context=2,tensor=2,data=2", "sample_tokens=0"],
            "ring": ["--steps", "3", "--mesh", "context=2,tensor=2,data=2", "--context-strategy", "ring",
                     "--micro-batch-size", "4", "--distributed-optimizer"]}
    done = {}

    def get(name):
        if name not in done:
            done[name] = str(tmp / name), command(train_command.main, *RUN, *runs[name], "--run-dir", str(tmp / name))
        return done[name]

    return get


# Both slow (three and two runs of the command, 13 s for the second): the fast tier resumes onto another layout with
# test_checkpoint's restore on another tensor size, and runs the step at context 2 in-process (the tests above;
# test_resume.py's fast row, resumed).
@pytest.mark.slow
def test_train_command_gives_the_losses_of_context_1(context_runs):
    """`python -m jaxseq.train --mesh context=2,tensor=2,data=2` (all-gather; the ring with gradient
    accumulation and the distributed optimizer, master shards split over data × context) against
    data=4,tensor=2 (dropout off here: accumulation draws each micro-batch's masks from its own key; the dropout
    comparisons are the tests above)."""
    dirs, done = {}, {}
    for name in ("1", "all-gather", "ring"):
        dirs[name], done[name] = context_runs(name)
    losses = {name: _losses(d) for name, d in dirs.items()}
    assert len(losses["1"]) == 5
    for name in ("all-gather", "ring"):
        assert len(losses[name]) == 3
        assert "context=2" in done[name].stdout
        np.testing.assert_allclose(losses[name], losses["1"][:3], rtol=1e-5)
    assert "sample (prompt" in done["ring"].stdout
    # Sampling runs in its own layout (no context axis): generate from a context-parallel run.
    gen = command(generate_command.main, "--run-dir", dirs["ring"], "--prompt", "def", "--max-tokens", "4")
    assert gen.stdout.startswith("# step 3\ndef"), gen.stdout


@pytest.mark.slow
def test_a_run_saved_at_context_2_resumes_at_context_1(context_runs, tmp_path):
    """The weights do not depend on `context`: 3 steps at context=2, resumed for 2 more at context=1, give the
    losses of 5 steps at context=1 (same schedule: the cosine ends at step 3 in both)."""
    moved = str(tmp_path / "moved")
    shutil.copytree(context_runs("all-gather")[0], moved)
    out = command(train_command.main, *RUN, "--steps", "5", "--mesh", "data=4,tensor=2", "--run-dir", moved,
                  "--resume", "sample_tokens=0")
    assert "data=4 × tensor=2" in out.stdout
    assert "context=2" in context_runs("all-gather")[1].stdout
    np.testing.assert_allclose(_losses(moved), _losses(context_runs("1")[0]), rtol=1e-5)


def test_parse_mesh_with_context():
    sizes = lambda text: tuple(parse_mesh(text, 8)[a] for a in ("pipe", "data", "context", "tensor"))
    assert sizes("context=4,tensor=2") == (1, 1, 4, 2)
    assert sizes("context=2,tensor=2") == (1, 2, 2, 2)
    assert sizes("data=2,tensor=4") == (1, 2, 1, 4)


@pytest.mark.parametrize("model,parallel,message", [
    (GPT, ParallelConfig(data=1, context=3, tensor=1), "seq_len=64 is not divisible by 2·context = 6"),
    (replace(GPT, seq_len=40), ParallelConfig(context=2, tensor=4, sequence_parallel=True),
     "seq_len=40 is not divisible by 2·context·tensor = 16"),
    (GPT, ParallelConfig(context=2, context_strategy="ulysses"), "context_strategy='ulysses' is not valid"),
    (GPT, ParallelConfig(data=2, context=2, tensor=4),
     "data×context×tensor = 2×2×4 = 16 does not equal the device count 8"),
    (GPT, ParallelConfig(context=0), "context=0 must be a positive integer"),
])
def test_bad_input_is_one_line(model, parallel, message):
    with pytest.raises(ConfigError) as e:
        validate_parallel(model, parallel, 8)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_why_the_rings_branches_are_padded_under_a_pipeline():
    """The XLA behaviour behind `context.same_context_permutes`, pinned so that the day it changes this test says
    so. Two stages, two ticks, as the executor runs them: at tick t one stage's branch sends 2·x over `context` (a
    ring step), the other's idles, then the executor's ppermute over `pipe` hands each stage's output to the other.
    Stage 1 should add stage 0's doubled, swapped x at tick 0; XLA:CPU pairs stage 0's context permute with stage
    1's pipe permute, and stage 1 receives stage 0's buffer from before its permute. With the idle branch padded to
    the same count of context permutes (one scalar send, as the executor pads), the result is right."""
    mesh = make_mesh(ParallelConfig(pipe=2, data=2, context=2, tensor=1), jax.devices())
    ring, idle = (lambda y: jax.lax.ppermute(2 * y, "context", [(0, 1), (1, 0)])), (lambda y: 0 * y)
    x = np.arange(1.0, 9.0, dtype=np.float32).reshape(2, 2, 2)  # [pipe, data, context]

    def run(pad: bool):
        def body(x):
            def tick(carry, t):
                which = jnp.asarray([[0, 1], [1, 0]])[t, jax.lax.axis_index("pipe")]
                branches = [ring, idle]
                if pad:
                    branches = same_context_permutes(branches, (carry,), lambda out, z: out + z)
                out = jax.lax.switch(which, branches, carry)
                return carry + jax.lax.ppermute(out, "pipe", [(0, 1), (1, 0)]), None
            return jax.lax.scan(tick, x, jnp.arange(2))[0]

        spec = P("pipe", "data", "context")
        return np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, axis_names={"pipe", "data", "context"},
                                                in_specs=spec, out_specs=spec))(x))

    stage1 = x[1] + 2 * x[0][:, ::-1]  # tick 0: stage 0's output, doubled and swapped over context
    right = np.stack([x[0] + 2 * stage1[:, ::-1], stage1])  # tick 1: stage 1's, back to stage 0
    got = run(pad=False)
    assert not np.array_equal(got, right)
    np.testing.assert_array_equal(got[1], x[1] + 2 * x[0])  # stage 0's buffer before its permute
    np.testing.assert_array_equal(run(pad=True), right)


def test_generate_and_convert_refuse_a_context_mesh():
    with pytest.raises(ConfigError, match="context parallelism is for training"):
        rundir.resolve_mesh(GPT, "context=2,tensor=4", jax.devices())


def test_a_bad_context_mesh_is_one_line_from_the_command(tmp_path):
    done = command(train_command.main, *TINY, "--mesh", "context=3,tensor=2", "--run-dir", str(tmp_path), check=False)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "context" in done.stderr
