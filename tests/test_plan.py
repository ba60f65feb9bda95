"""`python -m jaxseq.plan`: the JSON schema, Table-2 ratios at one small shape, whole-model memory
against the compiled train step and a hand count, the budget recommendation, and one-line errors."""

import dataclasses
import io
import json
import re

import jax
import pytest

from commands import command
from jaxseq import plan as plan_command
from jaxseq.config import ConfigError, ModelConfig, ParallelConfig, replace
from jaxseq.presets import preset
from jaxseq.mesh import make_mesh
from jaxseq.models import formulas as F
from jaxseq.models.formulas import PAPER_CONFIGURATIONS
from jaxseq.planning import hlo_flops, hlo_loops, in_flight, measure, memory, report
from jaxseq.planning import plan as P
from jaxseq.planning.recommend import block_row, compiled_block_bytes, recommend, replay_rank
from jaxseq.remat import POLICIES
from jaxseq.training import aot

# 5as/h = 5·8·128/64 = 80, as at GPT-3 175B; t = 4.
CFG = ModelConfig(vocab_size=1500, seq_len=128, hidden=64, heads=8, layers=4, dtype="bfloat16", dropout=0.1)
T, B = 4, 2


@pytest.fixture(scope="module")
def small_plan():
    # The paper's rows and one more policy keep the test to 10 compiles.
    return P.plan(CFG, T, B, jax.devices(), "small", policies=["lean"])


@pytest.mark.slow
def test_json_schema(small_plan):
    out = json.loads(json.dumps(small_plan.to_json()))
    assert {"model", "tensor", "seq_len", "micro_batch", "rows"} <= set(out)
    assert (out["model"], out["tensor"], out["seq_len"], out["micro_batch"]) == ("small", T, 128, B)
    keys = {"config", "remat", "sequence_parallel", "measured_bytes_per_layer", "formula_bytes_per_layer", "ratio",
            "flops_per_layer", "recompute_overhead_pct", "collective_bytes_per_layer", "total_bytes_per_device"}
    for row in out["rows"]:
        assert keys <= set(row)
    names = [r["config"] for r in out["rows"]]
    assert names[:7] == list(PAPER_CONFIGURATIONS)
    assert names[7:] == ["tp+lean", "tp+sp+lean"]
    extra = [r for r in out["rows"] if r["config"] not in PAPER_CONFIGURATIONS]
    assert all(r["formula_bytes_per_layer"] is None and r["ratio"] is None for r in extra)


@pytest.mark.slow  # the shared small plan
def test_the_table_keeps_a_negative_working_column_and_names_each_rows_memory_source(small_plan):
    """`plan --target`'s working memory is negative where the donated step reuses what the parts count twice (−5.3 GiB
    for gpt3-1.3b): its column's unit is the largest magnitude's, so the figure stays in its column; rows whose memory
    comes from different sources (a file of recorded GEMM choices holding some rows' steps) are each named."""
    rows = [dataclasses.replace(r, working_bytes_per_device=-5.3 * memory.GIB if i == 0 else 2048.0,
                                memory_source="source A" if i < 2 else "source B")
            for i, r in enumerate(small_plan.rows)]
    text = report.format_table(dataclasses.replace(small_plan, rows=rows))
    lines = {line.split()[0]: line.split() for line in text.splitlines() if line.split()
             and line.split()[0] in {r.config for r in rows}}
    assert {len(fields) for fields in lines.values()} == {len(lines[rows[1].config])}
    assert lines[rows[0].config][-2] == "-5.30" and "work. GiB" in text
    names = lambda source: ", ".join(r.config for r in rows if r.memory_source == source)
    assert f"{names('source A')}: source A; {names('source B')}: source B" in text


def test_every_registered_policy_is_planned_with_and_without_sp():
    rows = P.configurations(8)
    assert {(c.remat, c.sequence_parallel) for c in rows if c.tensor == 8} == {
        (p, sp) for p in POLICIES for sp in (False, True)}
    assert [c.name for c in rows if c.tensor == 1] == ["none"]
    assert [c.name for c in P.configurations(1)] == list(POLICIES)


@pytest.mark.slow
def test_table2_ratios_and_headlines(small_plan):
    for name in PAPER_CONFIGURATIONS:
        assert 0.98 <= small_plan.row(name).ratio <= 1.02, name
    tp, best = small_plan.row("tp"), small_plan.row("tp+sp+selective")
    assert best.measured_bytes_per_layer <= 0.25 * tp.measured_bytes_per_layer  # 0.21 at real h (LN stats vanish)
    assert small_plan.row("full+sp").ratio == 1.0  # exactly 2sbh/t


@pytest.mark.slow
def test_recompute_overheads_are_ordered(small_plan):
    over = {r.config: r.recompute_overhead_pct for r in small_plan.rows}
    # The baseline's FLOPs (L=2 minus L=0, split 4 ways) against a hand count of its matmuls, three
    # times each forward; softmax, LayerNorm, GELU and dropout's random bits add 59% at h=64.
    matmuls = 3 * sum(F.layer_matmul_flops(CFG, B).values()) / T
    assert matmuls < small_plan.row("tp").flops_per_layer < 1.8 * matmuls
    assert 0 < over["tp+selective"] < over["full"]
    # Full recompute adds less than one forward (the last matmul's output is never needed again);
    # at real widths it is forward − last matmul within 1% (see experiments/results).
    extra = small_plan.row("full").flops_per_layer - small_plan.row("tp").flops_per_layer
    assert 0.5 * small_plan.forward_flops_per_layer < extra < small_plan.forward_flops_per_layer


def hand_parameter_elements(cfg: ModelConfig, t: int) -> tuple[int, int]:
    """(all, cast to the compute dtype) parameter elements on one of t tensor ranks, counted by hand:
    the vocabulary padded to a multiple of 128·t and split t ways, like the QKV, output-projection
    rows, MLP and their column biases; positions, row biases and LayerNorms replicated."""
    h, s, f, L = cfg.hidden, cfg.seq_len, cfg.mlp_hidden, cfg.layers
    vocab = -(-cfg.vocab_size // (128 * t)) * 128 * t
    matrices = vocab * h // t + s * h + L * ((3 * h * h + 3 * h) // t + h * h // t + h + (h * f + f) // t
                                            + f * h // t + h)
    norms = L * 4 * h + 2 * h
    return matrices + norms, matrices


def compiled_state_bytes(ma, cfg: ModelConfig, b: int) -> int:
    """The train step's argument bytes less the batch (inputs and targets, int32), the RNG key (two
    uint32) and the three int32 step counters (the step, Adam's count, the schedule's count)."""
    return ma.argument_size_in_bytes - 2 * 4 * b * cfg.seq_len - 8 - 3 * 4


def compile_step(cfg, c: measure.RowSpec, b: int):
    parallel = ParallelConfig(data=1, tensor=c.tensor, sequence_parallel=c.sequence_parallel)
    mesh = make_mesh(parallel, jax.devices()[:c.tensor])
    return aot.compile_train_step(cfg, parallel, c.remat, mesh, b).memory_analysis()


def test_state_bytes_are_the_compiled_steps_arguments_and_a_hand_count():
    """bfloat16 with SP on 4 ranks, a vocabulary padded from 1500 to 1536: parameters and Adam
    moments are what the compiled train step takes, to the byte; the weight copy is 2 bytes per
    cast element."""
    c = measure.RowSpec("tp+sp+selective", "selective", True, T, None)
    state = memory.state_bytes(CFG, T)
    total, cast = hand_parameter_elements(CFG, T)
    assert (state.params, state.gradients, state.optimizer, state.weight_copy) == (4 * total, 4 * total, 8 * total,
                                                                                   2 * cast)
    ma = compile_step(replace(CFG, layers=measure.MEASURE_LAYERS), c, B)
    two = memory.state_bytes(replace(CFG, layers=measure.MEASURE_LAYERS), T)
    assert compiled_state_bytes(ma, CFG, B) == two.params + two.optimizer
    assert memory.state_bytes(replace(CFG, dtype="float32"), T).weight_copy == 0


# The peak margin: the plan leaves out the batch, the RNG key, the step counters and the step's
# outputs (loss, gradient norm, the output tuple's table), a few KiB; and it extrapolates from the
# program at L=2, whose temporaries beyond gradients and stored activations did not change with
# depth (to 64 bytes from L=4 to L=16 in a measurement). 0.2% of a few MiB covers both.
PEAK_MARGIN = 0.002


@pytest.mark.slow
def test_whole_model_peak_is_the_compiled_train_steps():
    """float32 (XLA:CPU's bf16 temporaries are not a GPU's): the plan's peak for 6 layers, measured
    at 2, against memory_analysis() of the real train step compiled with 6."""
    # also measured: none at t=1, full (docs/planning.md)
    c = measure.RowSpec("tp+sp+selective", "selective", True, T, None)
    cfg = replace(CFG, dtype="float32", layers=6)
    m = measure.Compiler(cfg, B, jax.devices()).measure(c)
    ma = compile_step(cfg, c, B)
    state = memory.state_bytes(cfg, c.tensor)
    assert compiled_state_bytes(ma, cfg, B) == state.params + state.optimizer
    compiled_peak = ma.argument_size_in_bytes + ma.temp_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
    row = P.make_row(cfg, c, m, B, cfg.layers, m.flops_per_layer, state)  # as plan() assembles it, unpipelined
    planned = row.total_bytes_per_device
    assert abs(planned / compiled_peak - 1) <= PEAK_MARGIN, (planned, compiled_peak)
    # The gradients, stored activations and working memory live in the step's temporaries.
    temp = state.gradients + row.activation_bytes_per_device + m.working_bytes
    assert abs(temp / ma.temp_size_in_bytes - 1) <= PEAK_MARGIN


@pytest.mark.slow
def test_budget_picks_least_recompute_that_fits(small_plan):
    tp = small_plan.row("tp")
    chosen, rejected = recommend(small_plan, tp.total_bytes_per_device + 1)
    assert chosen.config == "tp" and rejected == []
    best = small_plan.row("tp+sp+selective")
    chosen, rejected = recommend(small_plan, best.total_bytes_per_device)
    assert chosen.recompute_overhead_pct <= best.recompute_overhead_pct
    assert [r.config for r, _ in rejected][:2] == ["tp", "tp+sp"]
    assert all("GiB > budget" in why for _, why in rejected)
    chosen, rejected = recommend(small_plan, 1)
    assert chosen is None and len(rejected) == len([r for r in small_plan.rows if r.tensor == T])


def test_distributed_optimizer_bytes_per_parameter_are_megatrons():
    """bf16: 18 bytes per parameter (2 weight copy + 4 grads + 4 master + 8 moments) fall to 6 + 12/d;
    float32: 16 to 8 + 12/d (the copy is then a gathered fp32 one). From GPT-3 175B's own shapes and
    the train step's specs; LayerNorm parameters (no bf16 copy, gathered in f32) move it < 0.01%."""
    cfg = preset("gpt3-175b")
    elements, _ = memory.parameter_elements_per_device(cfg, 8)
    per_param = lambda state: state.total / elements
    assert abs(per_param(memory.state_bytes(cfg, 8, 64, False)) - 18) < 1e-3
    for d in (2, 8, 64):
        state = memory.state_bytes(cfg, 8, d, True)
        assert abs(per_param(state) - (6 + 12 / d)) < 1e-3, d
        if d <= 8:  # every GPT-3 tensor then has a dimension d divides (at 64 the [96, f/t] MLP bias has none)
            assert state.params * d == memory.state_bytes(cfg, 8).params
    f32 = replace(cfg, dtype="float32")
    assert abs(per_param(memory.state_bytes(f32, 8)) - 16) < 1e-9
    assert abs(per_param(memory.state_bytes(f32, 8, 8, True)) - (8 + 12 / 8)) < 1e-3
    # A leaf with no dimension d divides is counted whole: tiny's [L=2, f/t=128] MLP bias at d=4, t=2.
    tiny = preset("tiny")
    b = 2 * 128
    elements = memory.parameter_elements_per_device(tiny, 2)[0]
    assert memory.state_bytes(tiny, 2, 4, True).optimizer == 8 * ((elements - b) // 4 + b)


@pytest.mark.slow
def test_budget_and_table_consider_the_distributed_optimizer(small_plan):
    sharded = P.with_optimizer(small_plan, 4, True)
    r, s = small_plan.row("tp+sp+selective"), sharded.row("tp+sp+selective")
    assert s.activation_bytes_per_device == r.activation_bytes_per_device
    saved = r.total_bytes_per_device - s.total_bytes_per_device
    assert saved == (r.params_bytes_per_device + r.optimizer_bytes_per_device) * 3 / 4 - (
        s.weight_copy_bytes_per_device - r.weight_copy_bytes_per_device) > 0
    # A budget between the two: the row fits only with the distributed optimizer.
    budget = s.total_bytes_per_device + saved / 2
    rejected_without = [row.config for row, _ in recommend(small_plan, budget)[1]]
    chosen, rejected_with = recommend(sharded, budget)
    assert r.config in rejected_without and r.config not in [row.config for row, _ in rejected_with]
    assert chosen.recompute_overhead_pct <= s.recompute_overhead_pct
    text = report.format_table(sharded)
    assert "training state per device (t=4, d=4" in text and "the totals above use: with" in text
    state = sharded.to_json()["optimizer_state"]
    assert state["with_distributed_optimizer"]["bytes_per_device"]["total"] < state["without_distributed_optimizer"][
        "bytes_per_device"]["total"]
    assert "data=4 with the distributed optimizer" in report.format_recommendation(sharded, budget / memory.GIB)


@pytest.mark.parametrize("argv, message", [
    (["--preset", "gpt5"], "error: unknown preset 'gpt5'"),
    (["--preset", "gpt3-175b", "--tensor", "5"], "error: tensor=5 does not divide heads=96"),
    (["--preset", "tiny", "--budget-gib", "-1"], "error: budget_gib=-1 must be positive"),
    (["--preset", "tiny", "--budget-gib", "lots"], "error: argument --budget-gib: invalid float value: 'lots'"),
    (["--preset", "tiny", "--attention", "flash"], "error: attention='flash' is not valid"),
    (["--preset", "tiny", "--tensor", "1", "--data", "0"], "error: data=0 must be a positive integer"),
    (["--preset", "tiny", "--dtype", "float16"], "error: dtype='float16' needs loss scaling"),
    (["--preset", "tiny", "--tensor", "2", "--context", "2", "--context-strategy", "ulysses"],
     "error: context_strategy='ulysses' is not valid"),
    (["--preset", "tiny", "--tensor", "1", "--context", "3"], "error: seq_len=64 is not divisible by 2·context = 6"),
    (["--preset", "gpt3-175b", "--tensor", "16", "--pipeline", "96"],
     "error: pipeline=96 × tensor=16 = 1536 simulated devices to compile the pipelined step; at most 1024"),
    (["--preset", "tiny", "--tensor", "1", "--autotune-results", "at.textproto"],
     "error: --autotune-results at.textproto: GEMM choices for a GPU's program; it needs --target"),
    (["--preset", "tiny", "--search", "--gpus", "8", "--global-batch", "8", "--target", "h100", "--autotune-results",
      "at.textproto"], "error: --autotune-results: a recorded file holds one step's GEMM choices; --search compiles"),
    (["--preset", "tiny", "--search", "--gpus", "8", "--global-batch", "8", "--context-strategies", "ring,ulysses"],
     "error: context strategy 'ulysses' is not known; valid: all-gather, ring"),
])
def test_bad_input_is_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        raise SystemExit(plan_command.main(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


# (schedule, v, m) at p = 2, tensor = 4 + SP (8 devices), L = 8: k = 4, 4, 2 layers per chunk (compiled with 2).
PIPELINED = [("1f1b", 1, 4), ("gpipe", 1, 4), ("interleaved", 2, 4), ("zb-h1", 1, 4), ("zb-h1", 2, 4)]


@pytest.mark.slow
@pytest.mark.parametrize("schedule, v, m", PIPELINED,
                         ids=[c[0] + (f"-v{c[1]}" if c[0] == "zb-h1" and c[1] > 1 else "") for c in PIPELINED])
def test_pipeline_in_flight_is_read_from_the_compiled_pipelined_step(schedule, v, m, small_plan):
    """Stage 0's stash in the compiled tick loop, scaled from 2 layers per chunk to L/(p·v), is the schedule's
    in-flight count × k × the bytes the unpipelined layer stores (the plan's per-layer figure), and equals the
    paper's formula in layers (L; L·m/p; L·(1 + (p−1)/(p·v))); the output says which figures are compiled. Under
    zb-h1 its W stash per layer is `formulas.deferred_stash_bytes` (GPT with SP at c = 1, for
    tests/test_zero_bubble.py::test_the_w_stash_formula_is_the_compiled_carry, which holds Llama's and c = 2's)."""
    from jaxseq.parallel.schedule import Schedule

    cfg, p = replace(CFG, layers=8), 2
    row = P.pipeline_row(P.configurations(T, policies=[]))
    assert (row.name, row.remat, row.sequence_parallel, row.tensor) == ("tp+sp+selective", "selective", True, T)
    f = in_flight.compiled_in_flight(cfg, row, B, jax.devices(), schedule, p, v, m)
    sched, k = Schedule.make(schedule, p, m, v, cfg.layers), cfg.layers // (p * v)
    per_layer = small_plan.row(row.name).measured_bytes_per_layer  # the unpipelined program's, at L = 4
    assert f.slots == sched.in_flight(0) and f.layers_per_chunk == k and f.compiled_layers_per_chunk == 2
    assert f.compiled_stash_bytes == f.slots * 2 * per_layer
    assert f.stash_bytes == sched.in_flight(0) * k * per_layer
    assert f.layers == f.formula_layers == {"1f1b": 8, "gpipe": 16, "interleaved": 10, "zb-h1": 8}[schedule]
    # The bubble in time at the compiled branches' dot FLOPs; under zb-h1 the W stash and B + W = 1F1B's backward
    costs = f.branch_dot_flops
    assert f.lockstep_bubble == pytest.approx(sched.lockstep_bubble(costs["F"], costs["B"], costs["W"]))
    assert f.lockstep_bubble_1f1b == pytest.approx(
        Schedule.make("1f1b", p, m).lockstep_bubble(costs["F"], costs["B"] + costs["W"], 0))
    assert (f.w_slots, costs["W"] > 0) == ((sched.depths["w"], True) if schedule == "zb-h1" else (0, False))
    if schedule == "zb-h1":  # the W stash the plan adds to each row, per layer: formulas.deferred_stash_bytes (GPT, SP)
        per_layer_w = f.compiled_w_stash_bytes / (f.w_slots * f.compiled_layers_per_chunk)
        assert per_layer_w == F.deferred_stash_bytes(cfg, B, T, True) > 0
        assert f.w_stash_bytes == f.compiled_w_stash_bytes * k // f.compiled_layers_per_chunk
    act = B * CFG.seq_len * CFG.hidden * 2 // T  # one received bf16 activation shard (SP)
    assert f.receive_bytes >= 2 * act and f.receive_bytes % act == 0
    planned = dataclasses.replace(small_plan, config=cfg, pipeline=p, schedule=sched.name, virtual_stages=v,
                                  microbatches=m, in_flight=f, in_flight_layers=float(f.layers),
                                  bubble=sched.bubble, paper_bubble=sched.paper_bubble)
    text = report.format_table(planned)
    assert f"compiled  {f.slots} stash slots × 2 layers" in text and f"scaled    to {k} layers per chunk" in text
    assert f"source    compiled: the pipelined {sched.name} step (tp+sp+selective, pipe=2 × tensor=4" in text
    assert f"in time   {1 + f.lockstep_bubble:.4f} × the ideal" in text
    assert ("W stash   compiled" in text) == (schedule == "zb-h1")
    out = json.loads(json.dumps(planned.to_json()))
    assert out["in_flight"]["source"].startswith("compiled:") and out["in_flight"]["stash_bytes"] == f.stash_bytes
    # Each device's state by part: the stage's layers, and the embedding group's (master weights and moments
    # split over pipe, as the compiled step's arguments: tests/test_pipeline.py) beside Megatron's first stage's.
    stage = replace(cfg, layers=cfg.layers // p)
    parts = memory.state_bytes_by_part(stage, T, planned.data, planned.distributed_optimizer, pipe=p)
    whole = memory.state_bytes_by_part(stage, T, planned.data, planned.distributed_optimizer)[memory.EMBEDDING_GROUP]
    group = out["stage_state"]["embedding_group"]
    assert group["master_weights"] * p == out["stage_state"]["megatron_first_stage_embedding_group"]["master_weights"]
    assert group["total"] == parts[memory.EMBEDDING_GROUP].total < whole.total
    assert out["stage_state"]["layers"]["total"] + group["total"] == memory.state_bytes(
        stage, T, planned.data, planned.distributed_optimizer, p).total
    assert "state per device on every pipeline stage (p=2" in text and "Megatron first/last stage" in text


# Context parallelism: tiny GPT with dropout (bf16), t = 2 + SP, c = 2, b = 2 (4 simulated devices).
CONTEXT_CFG, CONTEXT_T, CONTEXT_B = replace(preset("tiny"), dtype="bfloat16"), 2, 2


@pytest.fixture(scope="module")
def context_compilers():
    """Per strategy, the plan's compiler of CONTEXT_CFG's programs at context 2 (`measure.Compiler`, t × c = 4
    devices, b = CONTEXT_B): a program compiled once for the module's tests that read it (the ring's selective layer
    with SP: test_context_layer_stores_the_formula_exactly's and a row of test_context_plan_rows_equal_the_formula)."""
    compilers = {s: measure.Compiler(CONTEXT_CFG, CONTEXT_B, jax.devices(), context=2, strategy=s)
                 for s in ("all-gather", "ring")}
    yield compilers
    for compiler in compilers.values():
        compiler.clear()


@pytest.mark.parametrize("strategy", ["all-gather", "ring"])
def test_context_layer_stores_the_formula_exactly(strategy, context_compilers):
    """The compiled layer at context 2 stores formulas.activation_bytes(context=2): every term / c (all-gather:
    no gathered K/V), the ring without scores and with its log-sum-exp (ring_lse: its output is the context,
    stored once). The loss-and-gradient program of CONTEXT_CFG's 2 layers, as the plan compiles it."""
    assert CONTEXT_CFG.layers == measure.MEASURE_LAYERS
    program = context_compilers[strategy]._compile("grad", CONTEXT_CFG.layers, "selective", CONTEXT_T, True)
    stored = hlo_loops.stored_bytes_per_layer(program.as_text(), CONTEXT_CFG.layers)
    formula = F.activation_bytes(CONTEXT_CFG, "selective", CONTEXT_B, CONTEXT_T, True, 2, strategy)
    assert stored == formula
    one = F.activation_bytes(CONTEXT_CFG, "selective", CONTEXT_B, CONTEXT_T, True)
    ring = F.layer_tensor_bytes(CONTEXT_CFG, CONTEXT_B, CONTEXT_T, True, 2)["ring_lse"]
    assert formula == one / 2 + (ring if strategy == "ring" else 0) and ring > 0


# GPT at c = 4 in the slow tier (13 s of ring compiles); the Llama's query tiles past the first too (one
# compile each): the fast tier keeps the default tile.
@pytest.mark.parametrize("name,t,sp,b,c,tiles", [
    pytest.param("tiny", 2, True, 2, 4, 1, marks=pytest.mark.slow), ("tiny-llama", 4, False, 1, 2, 1),
    pytest.param("tiny-llama", 4, False, 1, 2, 2, marks=pytest.mark.slow),
    pytest.param("tiny-llama", 4, False, 1, 2, 4, marks=pytest.mark.slow)])
def test_dots_under_the_ring_stores_its_blocks(name, t, sp, b, c, tiles, monkeypatch):
    """`dots` with the ring keeps every matmul output of the ring's forward: the 2c + 1 blocks a rank computes
    (context.attention_work), each a float32 q·kᵀ [b, a/t, n, n] and probs·v [b, n, a/t, d] (n = s/2c), and
    neither the ring's output nor its log-sum-exp (recomputed from the blocks): formulas.RING_POLICY_TERMS.
    GPT with dropout and SP; Llama with its 2 K/V heads repeated to t = 4; a block's query rows a tile at a time
    (`context.QUERY_TILE`) the same: its tiles' outputs stacked (and two tiles, straight-line code, no loop the
    plan's reader takes for the layer loop: as a scan of 2 they were, and the search failed on llama3-8b at 32k,
    c = 8)."""
    from jaxseq.parallel import context as CTX

    cfg = replace(preset(name), dtype="bfloat16")
    parallel = ParallelConfig(data=1, context=c, tensor=t, sequence_parallel=sp, context_strategy="ring")
    formula = F.activation_bytes(cfg, "dots", b, t, sp, c, "ring")
    n = cfg.seq_len // (2 * c)
    assert n <= CTX.QUERY_TILE  # one tile by default; else `tiles` of n / tiles rows each
    if tiles > 1:
        monkeypatch.setattr(CTX, "QUERY_TILE", n // tiles)
    text = aot.compile_loss_and_grad(cfg, parallel, "dots", make_mesh(parallel, jax.devices()[:c * t]), b).as_text()
    assert hlo_loops.stored_bytes_per_layer(text, cfg.layers) == formula
    n, e = cfg.seq_len // (2 * c), cfg.itemsize
    tokens, local = b * cfg.seq_len // c, cfg.heads // t
    blocks = (2 * c + 1) * 4 * b * local * n * (n + cfg.head_dim)
    assert F.layer_tensor_bytes(cfg, b, t, sp, c)["ring_blocks"] == blocks
    weight_outputs = e * tokens * (2 * cfg.hidden // (t if sp else 1) + (local + 2 * max(cfg.num_kv_heads, t) // t)
                                   * cfg.head_dim + (2 if cfg.family == "llama" else 1) * cfg.mlp_hidden // t)
    assert formula == weight_outputs + blocks


def test_context_kv_bytes_are_the_design_notes():
    """docs/DESIGN.md: all-gather holds 2·e·s·b·d·(kv heads per rank) (4·s·b·d·… in bf16), not / c; a ring two
    K/V blocks; traffic: 3 × (c−1)/c of the whole K/V (gathered forward and backward, dK/dV reduce-scattered),
    the ring 3c − 2 blocks."""
    cfg, b, t, c = preset("llama3-8b"), 1, 4, 4  # 8 K/V heads: 2 per tensor rank
    whole = 4 * cfg.seq_len * b * cfg.head_dim * 2
    gather = F.context_kv_bytes(cfg, b, t, c, "all-gather")
    assert (gather["transient"], gather["traffic"]) == (whole, 3 * (c - 1) / c * whole)
    ring = F.context_kv_bytes(cfg, b, t, c, "ring")
    assert (ring["transient"], ring["traffic"]) == (2 * whole / c, (3 * c - 2) * whole / c)
    assert F.context_kv_bytes(cfg, b, t, 1, "ring") == {"transient": 0.0, "transient_backward": 0.0, "traffic": 0.0}
    assert F.context_kv_bytes(cfg, b, 16, c, "all-gather")["transient"] == whole / 2  # t > kv heads: one each


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["all-gather", "ring"])
def test_context_plan_rows_equal_the_formula(strategy, context_compilers):
    """Every row `python -m jaxseq.plan --tensor 2 --context 2` prints (each registered policy, with and without SP,
    and `none` at t = 1; pairwise over the strategies, below): its layer's loss-and-gradient program, compiled at
    context 2 as the plan compiles it (`measure.Compiler`, the program `Compiler.measure` reads the stored bytes from),
    stores the plan's formula column, formulas.activation_bytes at context 2, to the byte. Only the stored bytes are
    read, so only that program is compiled (not the plan's float32 train step, L = 0 and forward programs); that the
    printed plan carries the compiled numbers beside the formula, and the K/V line, is
    test_context_plan_json_carries_the_rows_measurements."""
    rows = P.configurations(CONTEXT_T)
    assert {(c.remat, c.sequence_parallel) for c in rows if c.tensor == CONTEXT_T} == {
        (p, sp) for p in POLICIES for sp in (False, True)} and [c.name for c in rows if c.tensor == 1] == ["none"]
    # Pairwise (7 and 6 programs, not 13 and 13): every (policy, SP) pair under one strategy or the other. The
    # all-gather rows without SP (and `none` at t = 1), every policy; the ring's own terms (no scores, its
    # log-sum-exp) with SP, every policy. All-gather with SP is test_context_layer_stores_the_formula_exactly's
    # (and test_context_plan_json_carries_the_rows_measurements'); the ring without SP is held to the formula by
    # tests/test_search.py::test_search_for_a_llama_preset_predicts_its_compiled_layer.
    rows = [c for c in rows if c.sequence_parallel == (strategy == "ring")]
    compiler = context_compilers[strategy]  # the ring's selective row with SP compiled once, for both tests
    keys = [compiler.programs(c)[0] for c in rows]  # ("grad", MEASURE_LAYERS, remat, t, sp)
    compiler.compile_all(keys)
    for c, key in zip(rows, keys):
        stored = hlo_loops.stored_bytes_per_layer(compiler._compile(*key).as_text(), measure.MEASURE_LAYERS)
        formula = P.formula_bytes_per_layer(CONTEXT_CFG, c, CONTEXT_B, 2, strategy)
        assert stored == formula == F.activation_bytes(CONTEXT_CFG, c.remat, CONTEXT_B, c.tensor, c.sequence_parallel,
                                                       2, strategy), c.name


class ArithmeticOnly(measure.Compiler):
    """The plan's arithmetic without compiling: every row's layer measured alike (stored bytes, FLOPs, working)."""

    def __init__(self, *args, **kwargs):
        pass

    def programs(self, c):
        return []

    def forward_programs(self, tensor):
        return []

    def compile_all(self, keys):
        pass

    def measure(self, c):
        return measure.Measured(1000, 2e6 if c.remat == "full" else 1e6, {}, 500)

    def forward_flops_per_layer(self, tensor):
        return 1e6


class MarkedRows(ArithmeticOnly):
    """ArithmeticOnly whose stored bytes differ per row (1000 + the row's index in the plan), so that a printed row
    can be traced to the measurement it came from."""

    def measure(self, c):
        names = [r.name for r in P.configurations(c.tensor)]
        return measure.Measured(1000 + names.index(c.name), 1e6, {}, 500)


class AnnouncedOnly(ArithmeticOnly):
    """ArithmeticOnly that says each distinct program the plan would compile, as `measure.Compiler` does (a progress
    line as each starts), compiling none."""

    def __init__(self, *args, progress=None, **kwargs):
        self.progress, self._cache = progress, {}

    programs = staticmethod(measure.Compiler.programs)
    forward_programs = staticmethod(measure.Compiler.forward_programs)

    def compile_all(self, keys):
        for key in self.todo(keys):
            if self.progress is not None:
                self.progress.compiling(" ".join(map(str, key)))
            self._cache[key] = None


class DotsBelowNone(ArithmeticOnly):
    """ArithmeticOnly whose `dots` layer counts 0.2% fewer FLOPs than `none`'s, as XLA:CPU counted the tiny preset's
    with fused attention (−0.18%), and whose stored bytes fall as a policy replays more (every row but `none` fits a
    budget `none` misses)."""

    def measure(self, c):
        flops = {"none": 1e6, "dots": 0.998e6, "full": 1.3e6}.get(c.remat, 1.01e6)
        stored = {"none": 40000, "full": 100}.get(c.remat, 1000)
        collectives = {"all-reduce": 1000} | ({"all-gather": 500} if c.sequence_parallel else {})  # SP's gathers
        return measure.Measured(stored, flops, collectives, 500)


# A row without a formula (fused attention: a Llama's rows, or any row at context > 1) printed as the table prints it:
# the formula and ratio columns n/a, the headline's full+sp ratio too; the JSON keeps null.
NO_FORMULA_COMMANDS = [("--preset", "tiny-llama", "--tensor", "2", "--attention", "fused"),
                       ("--preset", "tiny", "--tensor", "2", "--context", "2", "--attention", "fused")]


@pytest.mark.parametrize("argv", NO_FORMULA_COMMANDS, ids=["llama", "context"])
def test_rows_without_a_formula_print_n_a_and_json_null(argv, monkeypatch):
    """`plan --preset tiny-llama --tensor 2 --attention fused` and `plan --preset tiny --tensor 2 --context 2
    --attention fused` ended in a TypeError formatting the headline's missing full+sp ratio. The layers' measurements
    are ArithmeticOnly's (the table's arithmetic, nothing compiled: what each command prints with XLA's numbers is
    checked by hand in the change that fixed it)."""
    monkeypatch.setattr(P, "Compiler", ArithmeticOnly)
    jax.devices()  # the backend started with conftest.py's 8 devices (not the first command's t·c, `host_devices`)
    text = command(plan_command.main, *argv).stdout
    rows = [line.split() for line in text.splitlines() if line.split() and line.split()[0] in {"tp", "full+sp"}]
    assert len(rows) == 2 and all(fields[5:7] == ["n/a", "n/a"] for fields in rows), rows
    assert "full+sp / (2sbh/t) = n/a" in text and "formula, ratio n/a: no formula counts that row's tensors" in text
    out = json.loads(command(plan_command.main, *argv, "--json").stdout)
    assert all(r["formula_bytes_per_layer"] is None and r["ratio"] is None for r in out["rows"])


def test_replay_rank_is_read_from_the_policies_definitions():
    """none replays nothing, full the whole forward but its last matmul, every other policy and a block recompute a
    part: the budget's first key (`recommend.recommend`)."""
    assert {name: replay_rank(name) for name in POLICIES} == {
        "none": 0, "selective": 1, "full": 2, "lean": 1, "dots": 1, "dots_no_batch": 1}
    assert replay_rank("full:1+none") == replay_rank("full:3+selective") == 1


def test_budget_ranks_by_what_a_policy_replays_before_xlas_flop_count(monkeypatch):
    """A policy replays, never saves, FLOPs: where XLA:CPU counts `dots` below `none` (fused attention), `plan --preset
    tiny --tensor 2 --attention fused --budget-gib 1` recommended tp+sp+dots over tp, which fits and replays nothing.
    Ranked by `replay_rank` first, then the measurement; a recompute below 0 is printed labelled as XLA:CPU's count,
    and the table says where its FLOP columns come from."""
    monkeypatch.setattr(P, "Compiler", DotsBelowNone)
    jax.devices()  # as above: 8 devices
    argv = ("--preset", "tiny", "--tensor", "2", "--attention", "fused", "--budget-gib", "1")
    text = command(plan_command.main, *argv).stdout
    assert "recommended: tp (remat=none, sequence_parallel=False)" in text and "recompute +0.00% FLOPs" in text
    assert "recompute below 0 (tp+dots -0.20%, tp+sp+dots -0.20%): XLA:CPU counted fewer FLOPs" in text
    assert f"FLOPs and recompute (over `none`'s FLOPs at the same t and SP): {P.FLOPS_SOURCE}" in text
    assert json.loads(command(plan_command.main, *argv, "--json").stdout)["budget"]["recommended"] == "tp"
    p = P.plan(preset("tiny"), 2, 1, jax.devices(), "tiny")
    budget = min(p.row("tp").total_bytes_per_device, p.row("tp+sp").total_bytes_per_device) - 1  # none misses it
    chosen, rejected = recommend(p, budget)  # the least measured recompute of the policies replaying a part
    assert [r.config for r, _ in rejected] == ["tp", "tp+sp"] and chosen.config == "tp+dots"
    text = report.format_recommendation(p, budget / memory.GIB)
    assert "(recompute +0.00%)" in text and "recommended: tp+dots (remat=dots, sequence_parallel=False)" in text
    assert "recompute -0.20% FLOPs measured (XLA:CPU's count, below none's program's: not a cost)" in text
    ranks = [replay_rank(r.remat) for r, _ in recommend(p, 1)[1]]
    assert ranks == sorted(ranks) and ranks[-2:] == [2, 2]


def stubbed_target_plan(monkeypatch, progress=None) -> P.Plan:
    """`plan --preset tiny --tensor 2 --target h100` with every program stubbed: the CPU's (AnnouncedOnly) and the GPU's
    (gpu_target's compiles: no CUDA plugin needed)."""
    monkeypatch.setattr(P, "Compiler", AnnouncedOnly)
    monkeypatch.setattr(P.gpu_target, "target_devices", lambda target, count: [None] * count)
    monkeypatch.setattr(P.gpu_target, "stored_bytes_per_layer", lambda *args, **kwargs: 1000)
    monkeypatch.setattr(P.gpu_target, "step_bytes", lambda *args: memory.GIB)
    program = P.gpu_target.StepProgram(memory.GIB, None, hlo_flops.GemmCount(0, 0), {})
    monkeypatch.setattr(P.gpu_target, "step_program", lambda *args, **kwargs: program)
    return P.plan(CONTEXT_CFG, CONTEXT_T, 1, jax.devices(), "tiny", target="h100", progress=progress)


def test_the_flop_columns_say_they_are_xla_cpus_with_a_target(monkeypatch):
    """With --target the stored bytes and totals are XLA:GPU's, the FLOPs and recompute still XLA:CPU's (a program
    compiled for a GPU without one counts none): the table said nothing of it."""
    text = report.format_table(stubbed_target_plan(monkeypatch))
    assert (f"FLOPs and recompute (over `none`'s FLOPs at the same t and SP): {P.FLOPS_SOURCE}, not the h100's (its "
            "programs, compiled without a GPU, count no FLOPs)") in text


def test_progress_totals_do_not_change_within_a_phase(monkeypatch):
    """`plan --target` counted 15/15, then 16/16 … 21/21 (each row's GPU programs told as they came), then 1/1 (the
    recommended block's step, a count started afresh unnamed). The plan's whole job is announced before its first
    program: the CPU's programs (said, not compiled: AnnouncedOnly) and each row's for the GPU (gpu_target's compiles
    stubbed: no CUDA plugin needed); a later phase is named and counted on its own, one of unknown size says so, and
    a program beyond the announced total says that."""
    from jaxseq.planning.progress import Progress

    stream = io.StringIO()
    progress = Progress("plan", stream)
    p = stubbed_target_plan(monkeypatch, progress)
    plan_lines = stream.getvalue().splitlines()
    counts = [re.match(r"plan: compiling (\d+)/(\d+): ", line).groups() for line in plan_lines]
    rows = P.configurations(CONTEXT_T)
    programs = len({k for c in rows for k in measure.Compiler.programs(c)}) + 2  # + the two forward programs
    assert counts == [(str(n), str(programs + len(rows))) for n in range(1, programs + len(rows) + 1)], plan_lines
    progress.phase("the recommended full:1+none", 1)
    compiled_block_bytes(p, block_row(p, p.row("full"), p.row("tp"), 1), "h100", progress)
    progress.phase("the best configurations' whole steps", None)
    progress.compiling("one")
    progress.compiling("two")
    progress.phase("one announced", 1)
    progress.compiling("three")
    progress.compiling("four")
    later = [line.rsplit(" (", 1)[0] for line in stream.getvalue().splitlines()[len(plan_lines):]]
    assert later == ["plan: the recommended full:1+none: 1 program",
                     "plan: compiling 1/1: full:1+none for h100: the whole train step",
                     "plan: the best configurations' whole steps: how many programs is not known until it ends",
                     "plan: compiling 1 (total not known): one", "plan: compiling 2 (total not known): two",
                     "plan: one announced: 1 program", "plan: compiling 1/1: three",
                     "plan: compiling 2 (1 announced): four"], later


def test_the_pipeline_block_prints_the_step_time_over_the_ideal(monkeypatch):
    """The bubble in time was printed as "in time 1.1693 of the ideal" for a step 2.17 × the ideal (time/ideal − 1);
    docs/parallelism.md gives the plain ratio: it is printed, said as such, beside the bubble and 1F1B's ratio."""
    monkeypatch.setattr(P, "Compiler", ArithmeticOnly)
    p = dataclasses.replace(P.plan(CONTEXT_CFG, CONTEXT_T, 1, jax.devices()[:2], "tiny", policies=[]), pipeline=2)
    f = in_flight.InFlight("compiled: a stand-in", "tp+sp+selective", 2, 2, 1, 4096, 2048, 512, "L", 2.0,
                           branch_dot_flops={"F": 1e9, "B": 2e9, "W": 0.0}, lockstep_bubble=1.1693,
                           lockstep_bubble_1f1b=0.6667)
    text = "\n".join(report.format_in_flight(dataclasses.replace(p, in_flight=f)))
    assert "in time   2.1693 × the ideal m·v·(F + B + W) per stage (bubble 1.1693)" in text
    assert text.endswith("1F1B at the same costs: 1.6667 × the ideal")


@pytest.mark.parametrize("strategy", ["all-gather", "ring"])
def test_context_plan_json_carries_the_rows_measurements(strategy, capsys, monkeypatch):
    """`python -m jaxseq.plan --tensor 2 --context 2 --json`: every printed row carries its layer's measurement
    (here marked per row, nothing compiled) beside its formula column, formulas.activation_bytes at context 2, and
    the K/V line is printed. That the compiled layer stores exactly the formula at context 2, every row, both
    strategies: test_context_plan_rows_equal_the_formula."""
    monkeypatch.setattr(P, "Compiler", MarkedRows)
    plan_command.main(["--preset", "tiny", "--dtype", "bfloat16", "--tensor", str(CONTEXT_T), "--micro-batch-size",
                       str(CONTEXT_B), "--context", "2", "--context-strategy", strategy, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert (out["context"], out["context_strategy"], out["tensor"]) == (2, strategy, CONTEXT_T)
    rows = P.configurations(CONTEXT_T)
    assert [row["config"] for row in out["rows"]] == [c.name for c in rows]
    for i, (row, c) in enumerate(zip(out["rows"], rows)):
        assert row["measured_bytes_per_layer"] == 1000 + i, row["config"]
        assert row["formula_bytes_per_layer"] == F.activation_bytes(CONTEXT_CFG, c.remat, CONTEXT_B, c.tensor,
                                                                     c.sequence_parallel, 2, strategy), row["config"]
    assert out["context_kv_bytes_per_layer"] == F.context_kv_bytes(CONTEXT_CFG, CONTEXT_B, CONTEXT_T, 2, strategy)


def test_state_tables_split_the_optimizer_over_data_and_context_as_the_rows(monkeypatch):
    """`plan --context 2 --data 2 --distributed-optimizer`: the rows, the state table (`optimizer_state`), the
    pipeline's per-stage table and `with_optimizer` all split master weights and moments over d·c = 4, one count."""
    monkeypatch.setattr(P, "Compiler", ArithmeticOnly)
    cfg, t = CONTEXT_CFG, CONTEXT_T
    p = P.plan(cfg, t, 1, jax.devices(), "tiny", policies=[], data=2, distributed_optimizer=True, context=2)
    row = p.row("tp+sp+selective")
    state = memory.state_bytes(cfg, t, 4, True)
    assert state.params < memory.state_bytes(cfg, t, 2, True).params  # d·c splits finer than d
    assert (row.params_bytes_per_device, row.optimizer_bytes_per_device, row.weight_copy_bytes_per_device) == (
        state.params, state.optimizer, state.weight_copy)
    table = p.optimizer_state()["with_distributed_optimizer"]["bytes_per_device"]
    assert (table["master_weights"], table["adam_moments"], table["weight_copy"], table["total"]) == (
        state.params, state.optimizer, state.weight_copy, state.total)
    assert P.with_optimizer(p, 2, True).rows == p.rows
    assert P.with_optimizer(p, 1, False).row(row.config).params_bytes_per_device == memory.state_bytes(cfg, t).params
    text = report.format_table(p)
    assert "training state per device (t=2, d=2, c=2," in text and "split over data × context = 4" in text
    piped = dataclasses.replace(p, pipeline=2)  # the per-stage table's arithmetic (the pipelined step not compiled)
    stage = piped.stage_state()
    whole = memory.state_bytes(replace(cfg, layers=cfg.layers // 2), t, 4, True, 2)
    assert stage["layers"]["total"] + stage["embedding_group"]["total"] == whole.total == piped.optimizer_state()[
        "with_distributed_optimizer"]["bytes_per_device"]["total"]


def test_plan_fsdp_splits_every_weights_state_and_holds_the_gathered_weights(monkeypatch):
    """`plan --fsdp 4`: each row's state is `memory.state_bytes` at fsdp=4 (master, moments and gradient over 4, no
    weight copy; tests/test_fsdp.py holds it to the compiled step's arguments), its working memory the layer's plus
    FSDP's gathered weights, named in the JSON and the table."""
    monkeypatch.setattr(P, "Compiler", ArithmeticOnly)
    cfg, t = CONTEXT_CFG, CONTEXT_T
    plain = P.plan(cfg, t, 1, jax.devices(), "tiny", policies=[])
    p = P.plan(cfg, t, 1, jax.devices(), "tiny", policies=[], fsdp=4)
    row, before = p.row("tp+sp+selective"), plain.row("tp+sp+selective")
    state = memory.state_bytes(cfg, t, fsdp=4)
    assert (row.params_bytes_per_device, row.gradient_bytes_per_device, row.optimizer_bytes_per_device,
            row.weight_copy_bytes_per_device) == (state.params, state.gradients, state.optimizer, 0)
    assert state.params < before.params_bytes_per_device / 3  # all but the biases and norm scales split 4 ways
    gathered = memory.fsdp_gathered_bytes(cfg, t, 4)
    assert row.fsdp_gathered_bytes_per_device == gathered > 0
    assert row.working_bytes_per_device == before.working_bytes_per_device + gathered
    assert row.activation_bytes_per_device == before.activation_bytes_per_device
    out = p.to_json()
    assert out["fsdp"] == 4 and out["rows"][-1]["params_bytes_per_device"] == p.rows[-1].params_bytes_per_device
    text = report.format_table(p)
    assert "training state per device (t=2, d=1, fsdp=4," in text and "FSDP's gathered weights" in text
    with pytest.raises(ConfigError, match="fsdp=3 does not divide hidden=64"):
        P.plan(cfg, t, 1, jax.devices(), "tiny", policies=[], fsdp=3)


def test_the_plan_says_what_it_compiles_on_stderr(monkeypatch):
    """A line as each program starts compiling, n of N announced before the first (two compile at a time, so the
    order of a pair may vary): the forward programs of the tiny preset at t = 1 (not compiled here: the line is
    said before XLA is asked)."""
    import io

    from jaxseq.planning.progress import Progress

    monkeypatch.setattr(measure.aot, "compile_forward", lambda *args: "compiled")
    stream = io.StringIO()
    progress = Progress("plan", stream)
    compiler = measure.Compiler(CONTEXT_CFG, 1, jax.devices(), progress=progress)
    keys = compiler.forward_programs(1)
    progress.expect(len(compiler.todo(keys)))
    compiler.compile_all(keys)
    compiler.compile_all(keys)  # compiled already: nothing more to say
    lines = sorted(line.rsplit(" (", 1)[0] for line in stream.getvalue().splitlines())
    assert [line.split(": ", 2)[1] for line in lines] == ["compiling 1/2", "compiling 2/2"], lines
    assert sorted(line.split(": ", 2)[2] for line in lines) == ["forward, 0 layers, none, t=1, b=1",
                                                                "forward, 2 layers, none, t=1, b=1"]


def test_recorded_gemm_choices_are_relabelled_with_this_cuda_build_and_only_cublas_ones():
    """A cuBLAS choice carries the CUDA build of the XLA that made it ("13.0.0" on the H100's CUDA 13 plugin), and an
    XLA of another build skips it (the plugin here is CUDA 12.9's): planning/autotune.py relabels those, and leaves
    Triton's (a commit hash), the native emitters' ("v1") and cuDNN's (cuDNN's own version) as they were."""
    from jaxseq.planning.autotune import relabelled

    entry = ('entries {{\n  key {{\n    target {{\n      device: "699b92c0fb30cb16"\n      hlo_fingerprint: "{f}"\n'
             '    }}\n  }}\n  value {{\n    optimal_config {{\n      backend: {b}\n    }}\n'
             '    optimal_backend_version: "{v}"\n  }}\n}}\n')
    recorded = "".join(entry.format(f=f, b=b, v=v) for f, b, v in [
        ("01", "CUBLASLT_FISSION", "13.0.0"), ("02", "TRITON", "a77e7c79"), ("03", "NATIVE_EMITTER", "v1"),
        ("04", "CUDNN", "9.19.0"), ("05", "CUBLAS", "13.0.0")])
    expected = "".join(entry.format(f=f, b=b, v=v) for f, b, v in [
        ("01", "CUBLASLT_FISSION", "12.9.0"), ("02", "TRITON", "a77e7c79"), ("03", "NATIVE_EMITTER", "v1"),
        ("04", "CUDNN", "9.19.0"), ("05", "CUBLAS", "12.9.0")])
    assert relabelled(recorded, "12.9.0") == expected
