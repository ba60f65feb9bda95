"""The pipeline executor equals the unpipelined model: loss and every gradient, float32, dropout on."""

import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxseq.config import OptimizerConfig, ParallelConfig, replace
from jaxseq.presets import preset
from jaxseq.mesh import make_mesh
from jaxseq.models import model as M
from jaxseq.models import ops as O
from jaxseq.parallel import pipeline as PL
from jaxseq.planning.stash import stash_layout
from jaxseq.parallel import ticks
from jaxseq.planning import hlo, hlo_collectives, hlo_flops, hlo_loops
from jaxseq.sharding import Sharder
from jaxseq.training import aot, loop
from jaxseq.training import train_step as T
from jaxseq.parallel.layout import Layout
from trees import comparable

# 8 layers: divisible by every p·v below. Micro-batches of 2 sequences (1 per data rank at data=2).
CFG = replace(preset("tiny"), hidden=32, heads=4, seq_len=16, layers=8, dtype="float32", dropout=0.1)
MICRO = 2
REMAT = "selective"

# (schedule, p, v, m, data, tensor, sequence parallel): every schedule at (2,1,4), (4,1,8), (2,2,4), (4,2,8),
# tensor=2 + SP inside the stages, and data=2.
CASES = [
    ("1f1b", 2, 1, 4, 1, 1, False),
    ("gpipe", 2, 1, 4, 1, 1, False),
    ("interleaved", 2, 2, 4, 2, 2, True),
    ("1f1b", 4, 1, 8, 2, 1, False),
    ("gpipe", 4, 1, 8, 1, 2, False),
    ("interleaved", 4, 2, 8, 1, 2, True),
]


def _batch(m, seed=0):
    tokens = np.random.default_rng(seed).integers(0, CFG.vocab_size, (MICRO * m, CFG.seq_len + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@pytest.fixture(scope="module")
def params():
    return M.init_params(jax.random.key(0), CFG)


@pytest.fixture(scope="module")
def reference(devices):
    """Gradient accumulation on one device: mean over micro-batch i of loss_and_grad(key = fold_in(key, i)).
    The remat policy does not change the values (the pipelined runs of every policy compare to this one)."""
    parallel = ParallelConfig()
    mesh = make_mesh(parallel, devices[:1])
    fns, cache = {}, {}

    def run(params, batch, key, m, dtype="float32"):
        if (m, dtype) not in cache:
            if dtype not in fns:
                fns[dtype] = T.make_loss_and_grad(Layout(replace(CFG, dtype=dtype), parallel, mesh), REMAT)
            losses, grads = [], []
            for i in range(m):
                mb = {k: v[i * MICRO:(i + 1) * MICRO] for k, v in batch.items()}
                loss, g = fns[dtype](params, mb, jax.random.fold_in(key, i))
                losses.append(float(loss))
                grads.append(jax.device_get(g))
            cache[m, dtype] = (np.mean(losses), jax.tree.map(lambda *g: np.mean(np.stack(g), axis=0), *grads))
        return cache[m, dtype]

    return run


def _assert_close(loss, grads, ref_loss, ref_grads, rtol=1e-5):
    assert abs(float(loss) - ref_loss) <= rtol * abs(ref_loss)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(comparable(jax.device_get(grads))),
                            jax.tree.leaves(comparable(ref_grads))):
        scale = np.max(np.abs(r))
        assert scale > 0, jax.tree_util.keystr(path)  # every parameter gets a gradient
        np.testing.assert_allclose(g, r, rtol=0, atol=rtol * scale, err_msg=jax.tree_util.keystr(path))


def _parallel(case) -> ParallelConfig:
    schedule, p, v, m, data, tensor, sp = case
    return ParallelConfig(data=data, tensor=tensor, sequence_parallel=sp, pipe=p, schedule=schedule, virtual_stages=v)


@pytest.fixture(scope="module")
def pipelined(devices):
    """(case, remat, dtype) → the pipelined loss-and-gradient program of a case and its abstract params,
    compiled once for every test of the module that reads it (pipeline compiles are the slow part of these
    tests; pyproject.toml's --dist loadfile keeps the module on one xdist worker)."""
    programs = {}

    def compiled(case, remat=REMAT, dtype="float32"):
        if (case, remat, dtype) not in programs:
            parallel = _parallel(case)
            mesh = make_mesh(parallel, devices[:parallel.num_devices])
            layout = Layout(replace(CFG, dtype=dtype), parallel, mesh)
            params, batch = aot.abstract_inputs(layout, MICRO * case[3])
            key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, P()))
            fn = PL.make_loss_and_grad(layout, remat, case[3])
            programs[case, remat, dtype] = (fn.lower(params, batch, key).compile(), params)
        return programs[case, remat, dtype]

    return compiled


def _run(pipelined, case, params, remat=REMAT, dtype="float32"):
    """(loss, grads, batch, key) of the compiled pipelined program on the test batch."""
    compiled, abstract = pipelined(case, remat, dtype)
    batch, key = _batch(case[3]), jax.random.key(7)
    placed = jax.tree.map(lambda a, s: jax.device_put(a, s.sharding), params, abstract)
    loss, grads = compiled(placed, batch, key)
    return loss, grads, batch, key


# The fast tier (-m "not slow") runs the first case: one pipelined program compiled and run.
@pytest.mark.parametrize("case", [CASES[0], *(pytest.param(c, marks=pytest.mark.slow) for c in CASES[1:])],
                         ids=lambda c: "{}-p{}v{}m{}-d{}t{}{}".format(*c[:6], "sp" if c[6] else ""))
def test_pipeline_equals_unpipelined(case, pipelined, params, reference):
    loss, grads, batch, key = _run(pipelined, case, params)
    _assert_close(loss, grads, *reference(params, batch, key, case[3]))


# Tensor=2 + SP inside the stages: the SP all-gather (a custom_vjp in the stage) under each policy.
REMAT_CASE = ("1f1b", 2, 1, 4, 1, 2, True)


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "dots", "full:3+selective"])
def test_remat_policies_inside_a_stage(remat, pipelined, params, reference):
    """What a stage stashes and recomputes follows the policy (test_stash_keeps_no_weights_or_keys checks
    the stash of `full`); the values do not change: loss and gradients equal the unpipelined model.
    `none`, `selective` (above) and `full` span the name whitelists (`lean` is another whitelist), `dots`
    JAX's by-primitive policies (as `dots_no_batch`); each compile costs ~10 s, so not all six. `full:3+selective`:
    block recompute of each stage's 4 layers, 3 under full, then 1 under selective (two scans in the stage). `full`
    alone is its first scan (`remat.segments`: a plain policy is one segment, a block spec one per policy, each run
    by the same `model.layers`), and ZB-H1's stages run it below (v2-d2-t2sp-full): not a compile of its own."""
    loss, grads, batch, key = _run(pipelined, REMAT_CASE, params, remat)
    _assert_close(loss, grads, *reference(params, batch, key, REMAT_CASE[3]))


@pytest.mark.slow
def test_bfloat16_pipeline_matches_bfloat16_unpipelined(pipelined, params, reference):
    """The bf16 pipeline against bf16 gradient accumulation on one device (same parameters, batch and keys).

    The tolerance (see test_bfloat16.py for the bf16-vs-f32 argument, u = 2⁻⁸): both programs round the
    same activations and cotangents to bf16 at the same op boundaries and send bf16 activations between
    stages as the scanned stack carries bf16 between layers; the loss gradient's 1/m (m = 4) is exact. They
    differ only where XLA fuses or orders an f32 accumulation differently (the two partitions differ: TP+SP
    and data=2 here, one device there) and a rounding to bf16 then falls the other way. Each such flip is
    ≤ u relative on one element, so a leaf differs by far less than test_bfloat16's 8 u; allowed: 8 u for
    the gradients (relative norm, as there) and u/8 for the loss. What it catches: a cast, scale or mask
    that the bf16 pipeline gets wrong (e.g. loss gradient or stage boundary in the wrong dtype), which
    shows as an O(1) or ≥ u-per-element systematic error."""
    u = 2.0 ** -8
    case = CASES[2]  # interleaved p=2, v=2, data=2, tensor=2 + SP
    loss, grads, batch, key = _run(pipelined, case, params, dtype="bfloat16")
    ref_loss, ref_grads = reference(params, batch, key, case[3], "bfloat16")
    assert abs(float(loss) - ref_loss) <= u / 8 * abs(ref_loss), (float(loss), ref_loss)
    f32_loss, f32_grads = reference(params, batch, key, case[3])
    grads, ref_grads, f32_grads = (comparable(jax.device_get(t)) for t in (grads, ref_grads, f32_grads))
    for (path, g), r, r32 in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads),
                                 jax.tree.leaves(f32_grads)):
        assert g.dtype == np.float32 and np.isfinite(g).all()
        err = np.linalg.norm(g - r) / np.linalg.norm(r)
        assert err <= 8 * u, f"{jax.tree_util.keystr(path)}: relative error {err:.2e}"
    # Guard: the reference really ran in bf16 (else the comparison would be an f32 one).
    assert abs(ref_loss - f32_loss) > 0 and any(
        np.linalg.norm(r - r32) / np.linalg.norm(r32) > u / 8 for r, r32 in zip(jax.tree.leaves(ref_grads),
                                                                                jax.tree.leaves(f32_grads)))


# ZB-H1: the backward split into B (input gradients) and W (the kernels' gradients, deferred); p=2 and p=4 with
# tensor=2 + SP (data parallelism: the Llama case below).
ZB_CASES = [("zb-h1", 2, 1, 4, 1, 2, True), ("zb-h1", 4, 1, 8, 1, 2, True), ("zb-h1", 2, 2, 4, 2, 2, True)]


@pytest.mark.parametrize("case,remat", [(ZB_CASES[0], REMAT), pytest.param(ZB_CASES[0], "dots", marks=pytest.mark.slow),
                                        pytest.param(ZB_CASES[1], REMAT, marks=pytest.mark.slow),
                                        pytest.param(ZB_CASES[2], "full", marks=pytest.mark.slow)],
                         ids=["t2sp-selective", "t2sp-dots", "p4-t2sp", "v2-d2-t2sp-full"])
def test_zero_bubble_equals_unpipelined(case, remat, pipelined, params, reference):
    """Loss and every gradient (the kernels', from W, included) equal the one-device reference, dropout on.
    Pairwise over the policies and the shapes: a name whitelist (selective, at p=2 and p=4; `lean` in the Llama
    test below), the whole replay (full, over 2 chunks with data=2: what it did at p=2 alone, and more) and JAX's
    by-primitive policies (dots), which see a deferred matmul by its name; every policy's stash is 1F1B's in
    tests/test_zero_bubble.py."""
    loss, grads, batch, key = _run(pipelined, case, params, remat)
    _assert_close(loss, grads, *reference(params, batch, key, case[3]))


def _switch_branch_flops(compiled, ticks: int) -> list[float]:
    """Dot FLOPs of each branch of the tick loop's lax.switch (XLA's compiled program, per device)."""
    comps = hlo.parse_hlo(compiled.as_text())
    body = hlo_loops.while_loop(comps, ticks).attr("body")
    switch, = [ins for ins in comps[body] if ins.opcode == "conditional" and len(ins.branches()) > 2]
    return [hlo_flops.dot_flops(comps, b) for b in switch.branches()]


@pytest.mark.slow
def test_zero_bubble_b_and_w_do_the_unsplit_backward_once(pipelined):
    """XLA's dot FLOPs per branch: B + W = 1F1B's backward, forward equal, for every backward branch (the first
    chunk's, which also runs the embedding's, and the others): no forward replayed beyond the policy's. Under
    `dots`, which keeps every matmul's output, so that a replayed forward matmul shows (the programs of the
    t2sp-dots and dots cases above)."""
    zb, one = ZB_CASES[0], REMAT_CASE
    assert zb[1:] == one[1:]
    flops_zb = _switch_branch_flops(pipelined(zb, "dots")[0], PL.schedule_of(_parallel(zb), zb[3], CFG.layers).ticks)
    flops_one = _switch_branch_flops(pipelined(one, "dots")[0],
                                     PL.schedule_of(_parallel(one), one[3], CFG.layers).ticks)
    B = ticks.Branch
    assert len(flops_zb) == len(flops_one) + 1 == len(B)
    for branch in (B.FORWARD, B.FORWARD_FIRST, B.FORWARD_LAST):
        assert flops_zb[branch] == flops_one[branch] > 0
    for branch in (B.BACKWARD, B.BACKWARD_FIRST):
        assert flops_zb[branch] + flops_zb[B.WEIGHT] == flops_one[branch]
        assert 0 < flops_zb[B.WEIGHT] < flops_zb[branch]  # W has the kernels' products; B the rest (attention's)


@pytest.mark.slow
def test_zero_bubble_llama_equals_unpipelined():
    """Llama (Q and K/V one column-parallel op of two kernels, SwiGLU) on pipe=2 × data=2 × tensor=2 + SP, lean
    policy: zb-h1's loss and gradients equal gradient accumulation's on one device, dropout on (as GPT's above; it
    compared with 1F1B's pipeline, which the Llama pipeline tests hold to one device: a pipelined compile more)."""
    cfg = replace(preset("tiny-llama"), hidden=32, heads=4, seq_len=16, layers=4, dtype="float32", dropout=0.1)
    m, micro, key = 4, MICRO * 2, jax.random.key(3)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (micro * m, cfg.seq_len + 1), np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    params = M.init_params(jax.random.key(0), cfg)
    parallel = ParallelConfig(data=2, tensor=2, sequence_parallel=True, pipe=2, schedule="zb-h1")
    layout = Layout(cfg, parallel, make_mesh(parallel, jax.devices()[:8]))
    with jax.set_mesh(layout.mesh):
        placed = jax.device_put(params, layout.param_shardings)
        loss, grads = jax.device_get(PL.make_loss_and_grad(layout, "lean", m)(placed, batch, key))
    one = ParallelConfig()
    loss_and_grad = T.make_loss_and_grad(Layout(cfg, one, make_mesh(one, jax.devices()[:1])), "lean")
    losses, all_grads = [], []
    for i in range(m):  # micro-batch i under fold_in(key, i), as the executor draws it
        part = {k: v[i * micro:(i + 1) * micro] for k, v in batch.items()}
        part_loss, part_grads = loss_and_grad(params, part, jax.random.fold_in(key, i))
        losses.append(float(part_loss))
        all_grads.append(jax.device_get(part_grads))
    _assert_close(loss, grads, np.mean(losses), jax.tree.map(lambda *g: np.mean(np.stack(g), axis=0), *all_grads))


def test_bernoulli_rows_are_rows_of_the_global_mask():
    """A data rank's dropout mask inside the executor (manual over `data`) equals its rows of
    jax.random.bernoulli of the global shape: the pipeline's masks are the unpipelined model's."""
    key = jax.random.key(3)
    rows_of = jax.jit(O.bernoulli_rows, static_argnums=(1, 2))  # one compile per shape, not per op
    for shape, ranks in (((8, 5, 7), 4), ((4, 3, 16, 16), 2), ((6, 100, 300), 3)):
        full = np.asarray(jax.random.bernoulli(key, 0.9, shape))
        rows = shape[0] // ranks
        for r in range(ranks):
            part = rows_of(key, 0.9, (rows, *shape[1:]), r * rows)
            np.testing.assert_array_equal(part, full[r * rows:(r + 1) * rows])
    # The 64-bit element index: products past 2³² elements, and strides past 2³² (modulo 2⁶⁴).
    xs = (1, 5000, 2**32 - 1)
    for c in (3_000_000_000, 2**32 + 12_345, 2**63 + 2**40 + 7):
        hi, lo = O._mul_u64(jax.numpy.asarray(xs, jax.numpy.uint32), c)
        assert [(int(h), int(l)) for h, l in zip(hi, lo)] == [divmod(x * c % 2**64, 2**32) for x in xs]


@pytest.mark.slow
def test_no_collective_permute_inside_a_branch(pipelined):
    """A collective that spans every stage inside a lax.switch branch deadlocks (only the stages taking
    that branch arrive): the only collective-permutes are the two ppermutes of the tick loop."""
    text = pipelined(CASES[2])[0].as_text()  # interleaved with data=2, tensor=2 + SP
    permutes = [line for line in text.splitlines() if " collective-permute(" in line]
    assert permutes and all("/cond/" not in line and "/ppermute" in line for line in permutes)


def _over_data(text: str, p: int, data: int, tensor: int):
    """(reductions inside a loop whose groups span two data ranks, reductions over the `data` groups
    outside any loop) of a compiled program on a pipe × data × tensor mesh."""
    ids = np.arange(p * data * tensor).reshape(p, data, tensor)
    data_of = ids // tensor % data
    data_groups = {tuple(int(i) for i in ids[s, :, t]) for s in range(p) for t in range(tensor)}
    reductions = hlo_collectives.reductions(text)
    spans_data = lambda r: r.groups is None or any(len({int(data_of.flat[i]) for i in g}) > 1 for g in r.groups)
    return ([r for r in reductions if r.in_loop and spans_data(r)],
            [r for r in reductions if not r.in_loop and r.groups and set(r.groups) == data_groups])


def _elements_per_device(tree, parallel: ParallelConfig) -> int:
    """Elements per device of the gradients of `tree` (a part of the parameters) split over pipe and tensor."""
    sizes = {"pipe": parallel.pipe, "tensor": parallel.tensor, "data": 1, None: 1}
    shapes, specs = M.param_shapes(CFG, parallel.tensor), M.param_specs(CFG, parallel)
    return sum(int(np.prod(shape)) // int(np.prod([sizes[a] for a in spec]))
               for shape, spec in zip(jax.tree.leaves(tree(shapes), is_leaf=lambda x: isinstance(x, tuple)),
                                      jax.tree.leaves(tree(specs), is_leaf=lambda x: isinstance(x, P))))


@pytest.mark.slow
@pytest.mark.parametrize("case", [CASES[2], CASES[3]], ids=["interleaved-d2t2sp", "1f1b-p4-d2"])
def test_one_data_gradient_reduction_per_step(case, pipelined):
    """As Megatron: the stages accumulate their gradients over the micro-batches locally and reduce them
    over `data` once per step, after the tick loop. No reduction inside the loop (a tick's branch included)
    spans two data ranks (one there would move the stage's gradients m·v times per step), and the
    all-reduces over the `data` groups after it carry each of the stage's layer gradients once (the
    embedding's and final LayerNorm's are reduced over pipe × data together)."""
    schedule, p, v, m, data, tensor, sp = case
    in_loop, after = _over_data(pipelined(case)[0].as_text(), p, data, tensor)
    assert not [r.op_name for r in in_loop]
    assert {r.kind for r in after} == {"all-reduce"}
    assert sum(r.elements for r in after) == _elements_per_device(lambda t: t["layers"], _parallel(case))


TRAIN_STEP_MICRO_BATCHES = 4  # the real train steps' (`train_steps`)


@pytest.fixture(scope="module")
def train_steps(devices):
    """distributed optimizer (bool) → (the real pipelined train step compiled on p=2 × data=2 × tensor=2 + SP, 1F1B,
    its layout, its abstract TrainState), each compiled once: the distributed optimizer's is read by two tests."""
    steps = {}

    def get(distributed: bool):
        if distributed not in steps:
            parallel = ParallelConfig(data=2, tensor=2, sequence_parallel=True, pipe=2, schedule="1f1b",
                                      distributed_optimizer=distributed)
            mesh = make_mesh(parallel, devices)
            layout = Layout(CFG, parallel, mesh)
            optimizer = T.make_optimizer(OptimizerConfig(), CFG)
            abstract = jax.eval_shape(lambda: T.init_state(jax.random.key(0), layout, optimizer))
            state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abstract,
                                 T.state_shardings(layout, optimizer))
            _, batch = aot.abstract_inputs(layout, MICRO * TRAIN_STEP_MICRO_BATCHES)
            key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, P()))
            step = T.make_train_step(layout, REMAT, optimizer, TRAIN_STEP_MICRO_BATCHES)
            steps[distributed] = (step.lower(state, batch, key).compile(), layout, abstract)
        return steps[distributed]

    return get


@pytest.mark.slow
def test_distributed_optimizer_reduce_scatters_the_gradients_once(train_steps):
    """The real train step with a pipeline and the distributed optimizer (p=2, data=2, tensor=2 + SP):
    the gradients leave the executor in the master shards, reduce-scattered over `data` once per step
    (Megatron's distributed optimizer: half an all-reduce's bytes), all-reduced only where a leaf has no
    dimension |data| divides (kept whole by `Layout.master_specs`); nothing over `data` in the loop."""
    compiled, layout, _ = train_steps(True)
    parallel = layout.parallel
    in_loop, after = _over_data(compiled.as_text(), 2, 2, 2)
    assert not [r.op_name for r in in_loop]
    scattered = [r for r in after if r.kind == "reduce-scatter"]
    whole = [r for r in after if r.kind == "all-reduce"]
    master = layout.master_specs
    split = lambda has_data: lambda t: jax.tree.map(lambda leaf, spec: leaf if ("data" in spec) == has_data else None,
                                                    t, master, is_leaf=lambda x: isinstance(x, tuple))
    assert sum(r.elements for r in scattered) * 2 == _elements_per_device(split(True), parallel)
    # Layers without such a dimension (the embedding's and final LayerNorm's go over pipe × data at once).
    # (The grad-norm's scalar partial sums may share those all-reduces: not counted.)
    assert sum(int(np.prod(d)) for r in whole for d in r.shapes if d) == \
        _elements_per_device(lambda t: split(False)(t)["layers"], parallel)


def test_stash_keeps_no_weights_or_keys(devices):
    """One stash slot holds only activations ([k, b, s, …] per leaf); the weights and dropout keys the
    chunk's vjp also lists as residuals are taken from the live arrays at backward (this leans on the
    layout of jax.vjp's residuals, hence the test)."""
    parallel = ParallelConfig(pipe=2)
    layout = Layout(CFG, parallel, make_mesh(parallel, devices[:2]))
    k = CFG.layers // 2
    stash, reused = stash_layout(layout, "full", 4, MICRO)
    # Full recompute: each layer keeps only its input.
    assert [(a.shape, a.dtype) for a in stash] == [((k, MICRO, CFG.seq_len, CFG.hidden), np.float32)]
    stash, reused = stash_layout(layout, REMAT, 4, MICRO)
    weight_shapes = {(k, *a.shape[1:]) for a in jax.tree.leaves(M.init_params(jax.random.key(0), CFG)["layers"])}
    assert all(a.shape[:3] == (k, MICRO, CFG.seq_len) for a in stash)
    assert {a.shape for a in reused} <= weight_shapes | {(k,)}  # weights and the k layer keys
    assert any(jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) for a in reused)


# ---------------------------------------------------------------------------------------------
# What the compiled program holds


def _tick_loop(text: str, ticks: int):
    """The `while` whose known trip count is the schedule's tick count (exactly one)."""
    loops = [ins for instrs in hlo.parse_hlo(text).values() for ins in instrs if ins.opcode == "while"
             and re.search(r'"known_trip_count":\{"n":"' + str(ticks) + r'"\}', ins.rest)]
    assert len(loops) == 1, f"{len(loops)} loops with trip count {ticks}"
    return loops[0]


def _table_bytes(sched) -> int:
    return sched.ticks * sched.p * len(ticks.FIELDS) * 4


def _stash_users(text: str, sched, k: int) -> tuple[set, list]:
    """(the opcodes that take a stash buffer at the top level of the compiled tick loop's body, through tuples
    to what takes those; the whole-buffer copies of a stash buffer anywhere in the loop). The stash buffers are
    the carry's [slots, k, b, …] arrays."""
    comps = hlo.parse_hlo(text)
    loop = _tick_loop(text, sched.ticks)
    carry = loop.arrays()
    stash = {n for n, (dt, dims) in enumerate(carry) if len(dims) > 3 and dims[:2] == (sched.depths["stash"], k)}
    assert len(stash) >= 2, carry
    body = comps[loop.attr("body")]
    param = next(ins.name for ins in body if ins.opcode == "parameter")
    users = hlo.users(body)
    index = lambda ins: int(re.search(r"index=(\d+)", ins.rest).group(1))
    buffers = [ins.name for ins in body if ins.opcode == "get-tuple-element" and ins.operands() == [param]
               and index(ins) in stash]
    taken = [u for b in buffers for u in users.get(b, [])]
    taken += [v for u in taken if u.opcode == "tuple" for v in users.get(u.name, [])]
    shapes = {carry[n] for n in stash}
    copies = [ins.name for c in hlo.called_computations(comps, loop.attr("body")) for ins in comps[c]
              if ins.opcode == "copy" and ins.arrays() and ins.arrays()[0] in shapes]
    return {u.opcode for u in taken if u.opcode != "tuple"}, copies


@pytest.mark.parametrize("case", [CASES[0], pytest.param(CASES[5], marks=pytest.mark.slow)], ids=lambda c: c[0])
def test_the_stash_is_written_on_forward_ticks_and_read_on_backward_ticks(case, pipelined):
    """In the compiled tick loop only conditionals take the stash buffers: a forward's residuals are written
    under a lax.cond on the branch, a backward reads its slot inside its branch of the switch. At the top of
    the loop body, which runs on every tick (idle ones included), nothing reads or writes them (the executor
    read a slot before its switch and wrote one back after it on every tick: 3 slot reads and writes per tick
    instead of 3 per forward-backward pair), and XLA copies no whole stash buffer."""
    schedule, p, v, m, data, tensor, sp = case
    sched = ticks.schedule_of(_parallel(case), m, CFG.layers)
    opcodes, copies = _stash_users(pipelined(case)[0].as_text(), sched, CFG.layers // (p * v))
    assert opcodes == {"conditional"} and not copies, (opcodes, copies)


def test_the_tick_loop_carries_no_zeros_of_a_chunks_gradients(pipelined):
    """What a switch branch returns for the outputs it has none of (zeros of the chunk's weight gradients, of
    the embedding's and final LayerNorm's, of a stash slot) is made inside the branch: made once before the
    loop, XLA carried each through the loop, one more f32 copy of a chunk's weight gradients in memory for the
    whole step (at GPT-3 175B, p = t = 8, v = 1: the stage's, ~10 GiB)."""
    case = CASES[0]
    schedule, p, v, m, data, tensor, sp = case
    sched = ticks.schedule_of(_parallel(case), m, CFG.layers)
    k = CFG.layers // (p * v)
    chunk_gradients = {("f32", (k, *a.shape[1:]))
                       for a in jax.tree.leaves(M.init_params(jax.random.key(0), CFG)["layers"])}
    carried = set(_tick_loop(pipelined(case)[0].as_text(), sched.ticks).arrays())
    assert not carried & chunk_gradients, carried & chunk_gradients


@pytest.mark.slow
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[5]], ids=lambda c: c[0])
def test_trip_count_is_the_schedule_tick_count(case, pipelined):
    sched = ticks.schedule_of(_parallel(case), case[3], CFG.layers)
    assert sched.ticks == 2 * sched.m * sched.v + 2 * (sched.p - 1)
    _tick_loop(pipelined(case)[0].as_text(), sched.ticks)


@pytest.mark.slow
def test_1f1b_memory_is_flat_in_m_and_gpipe_grows_linearly(devices, pipelined):
    """Compiled temp bytes from m = 2p to m = 4p (p = 2): 1F1B grows by the tick table alone; GPipe by one
    stash slot and one loss-gradient slot per extra micro-batch (plus the table, and up to `HEAP_PACKING`:
    the temp size is where XLA's packed heap ends, which moves by a few hundred bytes with the layout)."""
    slot = _stash_slot_bytes(devices)
    act = MICRO * CFG.seq_len * CFG.hidden * 4
    growth = {}
    for schedule in ("1f1b", "gpipe"):
        small, large = (schedule, 2, 1, 4, 1, 1, False), (schedule, 2, 1, 8, 1, 1, False)
        temp = [pipelined(c)[0].memory_analysis().temp_size_in_bytes for c in (small, large)]
        tables = [_table_bytes(ticks.schedule_of(_parallel(c), c[3], CFG.layers)) for c in (small, large)]
        growth[schedule] = (temp[1] - temp[0], tables[1] - tables[0])
    grown, table = growth["1f1b"]
    assert 0 <= grown <= table, growth
    grown, table = growth["gpipe"]
    assert 4 * slot <= grown <= 4 * (slot + act) + table + HEAP_PACKING, (growth, slot)


HEAP_PACKING = 2048  # bytes: GPipe's growth was 256 B under the bound at 14ed963, 1280 B over it since the stash
# is written under a lax.cond (its temp 240 KB smaller at both m); nothing else in the temp block grows with m


def _stash_slot_bytes(devices) -> int:
    parallel = ParallelConfig(pipe=2)
    stash, _ = stash_layout(Layout(CFG, parallel, make_mesh(parallel, devices[:2])), REMAT, 4, MICRO)
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in stash)


@pytest.mark.slow
@pytest.mark.parametrize("case,held", [(CASES[0], 2), (CASES[5], 4 * 2 + 4 - 1)], ids=["1f1b-p2", "interleaved-p4v2"])
def test_stage0_holds_the_schedules_chunk_inputs_at_the_plans_bytes(case, held, devices, pipelined):
    """The stash in the compiled tick loop: 1F1B holds p micro-batches, interleaved p·v + p − 1 chunk
    inputs, each k layers at the per-layer bytes the unpipelined program stores (what jaxseq.plan reads)."""
    schedule, p, v, m, data, tensor, sp = case
    sched = ticks.schedule_of(_parallel(case), m, CFG.layers)
    k = CFG.layers // (p * v)
    assert sched.depths["stash"] == sched.in_flight(0) == held
    loop = _tick_loop(pipelined(case)[0].as_text(), sched.ticks)
    stash = [(dt, dims) for dt, dims in hlo.tuple_elements(loop.shape) if dims[:2] == (held, k) and len(dims) > 3]
    stored = sum(hlo.array_bytes(dt, dims) for dt, dims in stash)
    plain = ParallelConfig(data=data, tensor=tensor, sequence_parallel=sp)
    per_layer = hlo_loops.stored_bytes_per_layer(
        aot.compile_loss_and_grad(CFG, plain, REMAT, make_mesh(plain, devices[:data * tensor]), MICRO).as_text(),
        CFG.layers)
    assert stored == held * k * per_layer


# ---------------------------------------------------------------------------------------------
# Evaluation under a pipeline: forward only through the stages


@pytest.fixture(scope="module")
def evaluation(devices):
    """case → (the loop's evaluation program compiled for it, its abstract params), compiled once."""
    programs = {}

    def compiled(case):
        if case not in programs:
            parallel = _parallel(case)
            mesh = make_mesh(parallel, devices[:parallel.num_devices])
            layout = Layout(CFG, parallel, mesh)
            params, batch = aot.abstract_inputs(layout, MICRO * case[3])
            params = jax.tree.map(lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                       sharding=NamedSharding(mesh, spec)),
                                  params, layout.master_specs)  # the train state's: its master weights
            program = loop.make_eval_fn(layout, case[3]).lower(params, batch).compile()
            programs[case] = (program, params)
        return programs[case]

    return compiled


EVAL_CASES = [CASES[0], CASES[5]]  # 1F1B p=2; interleaved p=4, v=2 with tensor=2 + SP


@pytest.mark.parametrize("case", EVAL_CASES, ids=lambda c: c[0])
def test_pipelined_evaluation_equals_the_unpipelined_loss(case, evaluation, params):
    """The loop's evaluation of a pipelined run (a forward-only schedule over the train step's micro-batches, no
    dropout) gives the unpipelined model's loss of the same parameters and batch, on one device."""
    program, abstract = evaluation(case)
    batch = _batch(case[3])
    placed = jax.tree.map(lambda a, s: jax.device_put(a, s.sharding), params, abstract)
    expected = float(M.loss_fn(params, batch, CFG, Sharder(None, False), "none"))
    assert abs(float(program(placed, batch)) - expected) <= 1e-6 * abs(expected)


def _spans_stages(groups, stage) -> bool:
    """Whether a collective's device groups (None: unread, or every device) span two pipeline stages."""
    return groups is None or any(len({int(stage[i]) for i in g}) > 1 for g in groups)


@pytest.mark.parametrize("case", EVAL_CASES, ids=lambda c: c[0])
def test_pipelined_evaluation_never_gathers_the_layers(case, evaluation):
    """The evaluation program of a pipelined run keeps each stage's layers on their stage: the only all-gathers
    that span two stages are of the embedding and the final LayerNorm, which every stage computes with (their
    master weights are split over `pipe`; the unpipelined loss of pipe-split weights all-gathered every layer
    over `pipe`, so every device held the whole model), and its temporaries stay below one full copy of the
    layers per device (the old program's exceeded it)."""
    schedule, p, v, m, data, tensor, sp = case
    program, abstract = evaluation(case)
    stage = np.arange(p * data * tensor) // (data * tensor)
    spanning = [ins.arrays()[0][1] for instrs in hlo.parse_hlo(program.as_text()).values() for ins in instrs
                if ins.opcode.removesuffix("-start") == "all-gather"
                and _spans_stages(hlo_collectives.replica_groups(ins.rest), stage)]
    parallel = _parallel(case)
    shapes, specs = M.param_shapes(CFG, tensor), M.param_specs(CFG, parallel)
    mesh = make_mesh(parallel, jax.devices()[:parallel.num_devices])
    embedding_group = {NamedSharding(mesh, spec).shard_shape(shape) for part in ("embed", "final_ln")
                       for shape, spec in zip(jax.tree.leaves(shapes[part], is_leaf=lambda x: isinstance(x, tuple)),
                                              jax.tree.leaves(specs[part], is_leaf=lambda x: isinstance(x, P)))}
    assert spanning and set(spanning) <= embedding_group, (spanning, embedding_group)
    full_layers = aot.per_device_bytes(abstract["layers"]) * p  # the layers of every stage, split over tensor
    assert program.memory_analysis().temp_size_in_bytes < full_layers


# ---------------------------------------------------------------------------------------------
# The embedding group's optimizer state, split over `pipe`


@pytest.mark.slow
@pytest.mark.parametrize("distributed", [False, True], ids=["adam", "distributed-optimizer"])
def test_each_stage_keeps_1_over_p_of_the_embedding_groups_optimizer_state(distributed, train_steps):
    """The real pipelined train step (p=2, data=2, tensor=2 + SP): every stage computes with the whole
    embedding and final LayerNorm, but each device's master weights and Adam moments of them are 1/p of
    their per-tensor-rank size (1/(p·d) with the distributed optimizer), read from the compiled program's
    input shardings (they were whole on every stage); and its arguments are jaxseq.plan's per-device state
    (`memory.state_bytes(one stage's layers, pipe=p)`: master weights + moments) to the byte."""
    from jaxseq.planning import memory

    compiled, layout, abstract = train_steps(distributed)
    parallel, mesh = layout.parallel, layout.mesh
    p, d, t, m = parallel.pipe, parallel.data, parallel.tensor, TRAIN_STEP_MICRO_BATCHES
    shardings = compiled.input_shardings[0][0]  # the TrainState's
    placed = lambda tree, sh: jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, sh)
    group = lambda tree: {"embed": tree["embed"], "final_ln": tree["final_ln"]}
    per_rank = sum(4 * int(np.prod(NamedSharding(mesh, spec).shard_shape(a.shape)))  # whole over pipe and data
                   for a, spec in zip(jax.tree.leaves(group(abstract.params)),
                                      jax.tree.leaves(group(M.param_specs(CFG, parallel)),
                                                      is_leaf=lambda x: isinstance(x, P))))
    split = p * d if distributed else p
    assert aot.per_device_bytes(placed(group(abstract.params), group(shardings.params))) * split == per_rank
    adam = shardings.opt_state[1][0]  # clip_by_global_norm's state, then adamw's: (ScaleByAdamState, …)
    for moment, sh in ((abstract.opt_state[1][0].mu, adam.mu), (abstract.opt_state[1][0].nu, adam.nu)):
        assert aot.per_device_bytes(placed(group(moment), group(sh))) * split == per_rank
    stage = replace(CFG, layers=CFG.layers // p)
    planned = memory.state_bytes(stage, t, d, distributed, pipe=p)
    batch_bytes = 2 * 4 * MICRO * m // d * CFG.seq_len
    counters = 3 * 4 + 8  # the step, Adam's count, the schedule's count (int32); the key (two uint32)
    assert (compiled.memory_analysis().argument_size_in_bytes - batch_bytes - counters
            == planned.params + planned.optimizer)


def test_the_executor_s_invariants_are_errors_not_asserts():
    """`python -O` strips asserts: a stash layout that changed since it was traced, or gradient specs whose
    layers are not split over pipe, raise errors that say what is wrong."""
    layout = PL.ResidualLayout(None, (-1,), (jax.ShapeDtypeStruct((2, 3), np.float32),))
    with pytest.raises(RuntimeError, match=r"vjp changed its layout .* 1 residual leaves \[\(4, 3\)\] where the stash "
                                           r"holds 1 \[\(2, 3\)\]"):
        layout.split([np.zeros((4, 3), np.float32)])
    specs = {"layers": {"mlp": {"wi": {"kernel": P(None, None, "tensor")}}}}
    with pytest.raises(ValueError, match=r"grad_specs: layers\['mlp'\]\['wi'\]\['kernel'\] is P\(None, "
                                         r"None, 'tensor'\); every layer's gradient is split over pipe"):
        PL.pipeline_loss_and_grad(None, None, None, layout=Layout(preset("tiny"), ParallelConfig(pipe=2, data=4)),
                                  remat="none", microbatches=2, grad_specs=specs)
