"""ZB-H1 (Qi et al., Zero Bubble Pipeline Parallelism, 2024): its schedule as data, its split backward's
stash (a kernel used twice in a layer included), and its one-line refusals. The executor's losses, gradients and
FLOPs: tests/test_pipeline.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxseq import deferred as D
from jaxseq import remat as R
from jaxseq import schedule as schedule_command
from jaxseq.config import ConfigError, ParallelConfig, replace, validate
from jaxseq.presets import preset
from jaxseq.mesh import make_mesh
from jaxseq.models import formulas
from jaxseq.planning.stash import residual_layouts
from jaxseq.parallel import schedule as S
from jaxseq.parallel.layout import Layout
from jaxseq.planning.in_flight import compiled_in_flight
from jaxseq.planning.measure import RowSpec

SHAPES = [(2, 2), (2, 4), (3, 5), (4, 4), (4, 8), (4, 16), (8, 8), (8, 32)]
# With v chunks per stage (m a multiple of p, as interleaving needs): m = p, the smallest, and m > p.
SHAPES_V = [(p, m, 1) for p, m in SHAPES] + [(2, 2, 2), (2, 4, 2), (3, 6, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3),
                                             (8, 16, 2), (4, 16, 4)]


@pytest.mark.parametrize("p,m,v", SHAPES_V)
def test_every_op_once_and_dependencies_respected(p, m, v):
    sched = S.Schedule.make("zb-h1", p, m, v)
    when = {}
    for t, row in enumerate(sched.timeline):
        for s, op in enumerate(row):
            if op is not None:
                assert (s, op) not in when
                when[(s, op)] = t
    assert set(when) == {(s, S.Op(k, i, c)) for s in range(p) for i in range(m) for c in range(v) for k in "FBW"}
    for (s, op), t in when.items():
        i, c = op.mb, op.chunk
        if op.kind == "F" and (s > 0 or c > 0):
            assert when[(s - 1, op) if s > 0 else (p - 1, S.Op("F", i, c - 1))] < t  # its input
        if op.kind == "B":
            assert when[(s, S.Op("F", i, c))] < t
            if s < p - 1 or c < v - 1:  # the input gradient of the next stage (chunk), not its W
                assert when[(s + 1, op) if s < p - 1 else (0, S.Op("B", i, c + 1))] < t
        if op.kind == "W":
            assert when[(s, S.Op("B", i, c))] < t


@pytest.mark.parametrize("p,m,v", SHAPES_V)
def test_bubble_is_a_third_of_1f1b_at_unit_costs(p, m, v):
    """Qi et al.: (p − 1)/(3m) at F = B = W, from the tick table: 3m + p − 1 ticks of which p − 1 idle; with v
    chunks 3mv + p − 1 ticks, (p − 1)/(3vm): a third of interleaved 1F1B's (p − 1)/(vm)."""
    zb, one = S.Schedule.make("zb-h1", p, m, v), S.Schedule.make("1f1b", p, m, v)
    assert zb.ticks == 3 * m * v + p - 1 and zb.idle_ticks == p - 1 and zb.busy_ticks == 3 * m * v
    assert zb.bubble == pytest.approx((p - 1) / (3 * v * m)) == zb.paper_bubble
    assert zb.bubble == pytest.approx(one.bubble / 3)


@pytest.mark.parametrize("p,m,v", SHAPES_V)
def test_in_flight_is_1f1b_s_and_the_w_stash_is_named(p, m, v):
    """Activations held between an F and its B: 1F1B's p − s on stage s; with v chunks (v − 1)·p + p − s chunks
    of L/(pv) layers, so stage 0 holds L layers as under 1F1B, where interleaved 1F1B's holds L·(1 + (p − 1)/(pv)).
    Deferred W's: s + 1, at most p; the executor's one SPMD program gives every stage p W stash slots."""
    zb, one = S.Schedule.make("zb-h1", p, m, v), S.Schedule.make("1f1b", p, m, v)
    assert [zb.in_flight(s) for s in range(p)] == [v * p - s for s in range(p)]
    assert zb.in_flight_layers(p * v * 4) == S.Schedule.make("1f1b", p, m).in_flight_layers(p * v * 4) == p * v * 4
    if v == 1:
        assert [one.in_flight(s) for s in range(p)] == [p - s for s in range(p)] and one.depths["stash"] == p
    else:
        assert one.in_flight(0) >= zb.in_flight(0)  # interleaved 1F1B's warm-up: 2(p − s − 1) + (v − 1)·p
    assert zb.depths["stash"] == v * p
    assert [zb.deferred(s) for s in range(p)] == [min(s + 1, m) for s in range(p)]
    assert zb.depths["w"] == max(zb.deferred(s) for s in range(p)) and one.depths["w"] == 0
    assert all(one.deferred(s) == 0 for s in range(p))


@pytest.mark.parametrize("p,m,v", SHAPES_V)
def test_lockstep_time_weighs_each_tick_by_its_slowest_op(p, m, v):
    """At F = B = W = 1 (1F1B's whole backward costs 2): 1F1B's first p ticks run forwards only and every later
    tick some stage's backward, 4m + 3p − 4 units (docs/DESIGN.md: (2m + 2(p − 1)) ticks at t_b ≈ 2t_f); ZB-H1's
    ticks cost 1 each, 3mv + p − 1."""
    zb = S.Schedule.make("zb-h1", p, m, v)
    assert zb.lockstep_time(1, 1, 1) == 3 * m * v + p - 1
    assert zb.lockstep_bubble(1, 1, 1) == pytest.approx(zb.bubble)
    if v == 1:
        one = S.Schedule.make("1f1b", p, m)
        assert one.lockstep_time(1, 1, 1) == 4 * m + 3 * p - 4
        assert one.lockstep_bubble(1, 1, 1) == pytest.approx((4 * m + 3 * p - 4) / (3 * m) - 1)


def test_the_order_is_pytorchs_interleaved_zero_bubble():
    """Each stage's F/B/W order equals PyTorch's `ScheduleInterleavedZeroBubble` (ZB1P: the same warm-up, each
    stage's first s weight gradients deferred), v = 1…3; its op lists, built without a process group, are the
    outside reference (torch is pinned in requirements-test.txt)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    kind = {schedules._ComputationType.FORWARD: "F", schedules._ComputationType.BACKWARD_INPUT: "B",
            schedules._ComputationType.BACKWARD_WEIGHT: "W"}
    for p, m, v in [(2, 2, 1), (2, 6, 1), (4, 4, 1), (4, 8, 1), (2, 4, 2), (4, 4, 2), (4, 8, 2), (3, 6, 3),
                    (4, 12, 3)]:
        theirs = object.__new__(schedules.ScheduleInterleavedZeroBubble)  # its op lists need no stages
        theirs.pp_group_size, theirs.n_local_stages, theirs._n_microbatches = p, v, m
        theirs.number_of_rounds = max(1, m // p)
        theirs.microbatches_per_round = m // theirs.number_of_rounds
        for s in range(p):
            ops = [S.Op(kind[a.computation_type], a.microbatch_index, a.stage_index // p)
                   for a in theirs._calculate_single_rank_operations(s) if a is not None]
            assert S.Schedule.make("zb-h1", p, m, v).order(s) == ops, (p, m, v, s)


@pytest.mark.parametrize("p,m,v", [(2, 4, 1), (4, 8, 1), (3, 7, 1), (4, 8, 2)])
def test_slot_tables_pair_each_w_with_its_b(p, m, v):
    sched = S.Schedule.make("zb-h1", p, m, v)
    tab, written = sched.tables, {}
    for t in range(sched.ticks):
        for s in range(p):
            key = (s, int(tab["mb"][t, s]), int(tab["chunk"][t, s]))
            if tab["kind"][t, s] == S.BACKWARD:
                assert 0 <= tab["w_slot"][t, s] < sched.depths["w"]
                assert tab["w_slot"][t, s] not in {v for k, v in written.items() if k[0] == s}  # a free slot
                written[key] = tab["w_slot"][t, s]
            elif tab["kind"][t, s] == S.WEIGHT:
                assert tab["w_slot"][t, s] == written.pop(key)
            else:
                assert tab["w_slot"][t, s] == -1
    assert not written


def test_forward_only_runs_the_forwards():
    sched = S.Schedule.make("zb-h1", 4, 8, forward_only=True)
    assert not sched.split_backward and sched.ticks == 8 + 3 and sched.depths["w"] == 0


def test_cli_prints_the_timeline_the_bubble_and_the_w_stash(capsys):
    assert schedule_command.main(["--pipe", "4", "--microbatches", "8", "--schedule", "zb-h1"]) == 0
    out = capsys.readouterr().out
    assert "ticks 27 (lock-step 3m + p − 1 = 27)" in out
    assert "bubble idle/busy = 0.1250 vs the paper's (p−1)/(3m) = 0.1250" in out
    assert "deferred weight gradients held per stage: 1, 2, 3, 4; W stash slots 4" in out
    assert "stage 0:  F0 F1 F2 F3  .  .  . B0 W0 F4 B1 W1" in out


@pytest.mark.parametrize("parallel,model,message", [
    (dict(pipe=2, data=2, fsdp=2, schedule="zb-h1"), "tiny", "schedule=zb-h1 with fsdp=2 is not supported"),
    (dict(pipe=2, tensor=4, schedule="zb-h1"), "tiny-llama", "tensor=4 > kv_heads=2 is not supported"),
])
def test_what_zb_h1_cannot_run_is_one_line(parallel, model, message):
    cfg = replace(preset(model), layers=4, heads=4) if model == "tiny-llama" else replace(preset(model), layers=4)
    if model == "tiny-llama":
        assert cfg.num_kv_heads == 2
    with pytest.raises(ConfigError, match=message) as err:
        validate(cfg, ParallelConfig(**parallel), "selective")
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------
# The split backward's stash

STASH_CFG = {family: replace(preset(family), hidden=32, heads=4, seq_len=16, layers=8, dtype="bfloat16")
             for family in ("tiny", "tiny-llama")}


def _layout(cfg, schedule, devices, tensor=2, sp=True):
    parallel = ParallelConfig(tensor=tensor, sequence_parallel=sp, pipe=2, schedule=schedule)
    return Layout(cfg, parallel, make_mesh(parallel, devices[:parallel.num_devices]))


FAST_POLICIES = ("selective", "dots")  # the fast tier's: the default, and the one whose names are the matmuls'


@pytest.mark.parametrize("family,policies", [
    pytest.param("tiny", FAST_POLICIES, id="tiny"),
    pytest.param("tiny", tuple(p for p in R.POLICIES if p not in FAST_POLICIES), marks=pytest.mark.slow,
                 id="tiny-rest"),
    pytest.param("tiny-llama", tuple(R.POLICIES), marks=pytest.mark.slow, id="tiny-llama")])
def test_an_f_stashes_what_it_stashes_under_1f1b_for_every_policy(family, policies, devices):
    """Deferring the weight gradients changes nothing a forward keeps for its B (the same residual leaves, each
    the same shape, the same ones, in another order, taken from the weights), under every registered policy (GPT's
    split between the tiers: 2.4 s of tracing each); the W stash is the same whatever the policy (the matmuls' inputs
    and output gradients, each [k, …]), and empty under 1F1B."""
    cfg = STASH_CFG[family]
    zb, one = _layout(cfg, "zb-h1", devices), _layout(cfg, "1f1b", devices)
    shapes = lambda avals: [(a.dtype, a.shape) for a in avals]
    w_stashes = set()
    for policy in policies:
        split, whole = residual_layouts(zb, policy, 4, 2), residual_layouts(one, policy, 4, 2)
        assert shapes(split["stash"]) == shapes(whole["stash"]), policy
        assert sorted(map(str, shapes(split["reused"]))) == sorted(map(str, shapes(whole["reused"]))), policy
        w_stashes.add(tuple(shapes(split["w_stash"])))
        assert whole["w_stash"] == [] and split["w_stash"]
    assert len(w_stashes) == 1


@pytest.mark.slow
@pytest.mark.parametrize("family,tensor,sp,context", [("tiny-llama", 2, False, 1), ("tiny", 2, True, 2)])
def test_the_w_stash_formula_is_the_compiled_carry(family, tensor, sp, context, devices):
    """`formulas.deferred_stash_bytes`, which the plan adds to each row, against the W stash buffers of the
    compiled pipelined step's tick loop (per device, with and without SP; Llama's Q and K/V share one input; at
    context 2 a rank's s/2 tokens). GPT with SP at context 1: tests/test_plan.py's
    test_pipeline_in_flight_is_read_from_the_compiled_pipelined_step[zb-h1, zb-h1-v2], on the zb-h1 steps it
    compiles anyway (t = 4, v = 1 and 2)."""
    cfg = replace(STASH_CFG[family], hidden=64, seq_len=32)
    f = compiled_in_flight(cfg, RowSpec("row", "selective", sp, tensor, None), 2, devices, "zb-h1", 2, 1, 4,
                           context, "all-gather")
    assert f.w_slots == 2
    per_layer = f.compiled_w_stash_bytes / (f.w_slots * f.compiled_layers_per_chunk)
    assert per_layer == formulas.deferred_stash_bytes(cfg, 2, tensor, sp, context)
    assert f.w_stash_bytes == f.compiled_w_stash_bytes * f.layers_per_chunk // f.compiled_layers_per_chunk


# ---------------------------------------------------------------------------------------------
# One kernel, two deferred matmuls in a layer

def _toy_layers(x, weights):
    """[k] layers of tanh(mm(tanh(mm(x, w)), w)): the layer's one kernel feeds two deferred matmuls."""
    mm = lambda x, w: x @ w

    def layer(x, w):
        return jnp.tanh(D.apply(mm, jnp.tanh(D.apply(mm, x, w["kernel"])), w["kernel"])), None

    return jax.lax.scan(layer, x, weights)[0]


def test_a_kernel_used_twice_in_a_layer_gets_both_uses_gradients():
    """The split backward (B's probes, W's `Taps.weight_gradients`) of a toy layer whose kernel feeds two matmuls:
    the W stash holds each use's (x, dy), and the kernel's gradient is jax.vjp's of the plain layers, both uses
    summed (keyed by the kernel alone, the second use overwrote the first and shared its probe: here one stash
    entry, and the gradient off by 4.21 where its largest entry is 3.88)."""
    k, b, h = 2, 4, 8
    keys = jax.random.split(jax.random.key(0), 3)
    x, dy = jax.random.normal(keys[0], (b, h)), jax.random.normal(keys[1], (b, h))
    weights = {"kernel": jax.random.normal(keys[2], (k, h, h)) / np.sqrt(h)}
    _, plain_vjp = jax.vjp(_toy_layers, x, weights)
    want_dx, want = plain_vjp(dy)

    taps = D.Taps()
    taps.discover(_toy_layers, weights, x)
    kernels, others = D.split_kernels(weights)
    split = lambda x, others, probes: _toy_layers(x, taps.wrap(D.merge_kernels(kernels, others), probes))
    _, b_vjp = jax.vjp(split, x, others, taps.probes(k))
    dx, _, stash = b_vjp(dy)
    assert len(stash) == 2  # the W stash: each use's (x, dy), [k, …]
    first, second = (stash[D.use_key("['kernel']", use)] for use in (0, 1))
    np.testing.assert_allclose(first[0][0], x, rtol=1e-6)  # layer 0's first matmul's input: the layers' input
    np.testing.assert_allclose(second[0][0], jnp.tanh(x @ weights["kernel"][0]), rtol=1e-6)
    got = taps.weight_gradients(weights, stash)["['kernel']"]
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, want["kernel"], rtol=1e-5, atol=1e-5 * np.abs(want["kernel"]).max())


def test_a_use_that_discovery_did_not_see_is_refused_naming_the_kernel():
    """A layer that feeds a kernel to more deferred matmuls than the discovery trace saw would lose those uses'
    gradients: refused in one line naming the kernel."""
    x, weights = jnp.ones((4, 8)), {"kernel": jnp.ones((2, 8, 8))}
    once = lambda x, weights: jax.lax.scan(lambda x, w: (D.apply(lambda x, w: x @ w, x, w["kernel"]), None),
                                           x, weights)[0]
    taps = D.Taps()
    taps.discover(once, weights, x)
    kernels, others = D.split_kernels(weights)
    with pytest.raises(RuntimeError, match=r"the kernel \['kernel'\] feeds 2 deferred matmuls .* found 1") as e:
        _toy_layers(x, taps.wrap(D.merge_kernels(kernels, others), taps.probes(2)))
    assert "\n" not in str(e.value)
