"""Megatron-LM's block recompute (`--remat full:N[+POLICY]`): the first N layers of each chunk under `full`, the rest
under POLICY. Checked against XLA's own programs: each segment's layer loop stores its policy's bytes, the FLOPs
are the policies' by layer, loss and gradients equal `none`'s, and the plan's composed row is the compiled step's
peak."""

import json

import jax
import numpy as np
import pytest

from jaxseq.config import ConfigError, ModelConfig, ParallelConfig, replace, validate
from jaxseq.presets import preset
from jaxseq.mesh import make_mesh
from jaxseq.models import formulas as F
from jaxseq.models import model as M
from jaxseq.parallel.layout import Layout
from jaxseq.planning import hlo_flops, hlo_loops
from jaxseq.planning import measure
from jaxseq.planning import memory
from jaxseq.planning import plan as P
from jaxseq.planning.recommend import block_row, recommend
from jaxseq.planning import report
from jaxseq.planning.hlo import array_bytes, entry_name, parse_hlo
from jaxseq.remat import layer_counts, segments
from jaxseq.training import aot
from jaxseq.training import train_step as T

from compiled import MEMORY_CFG, hlo
from trees import comparable


@pytest.mark.parametrize("remat, parallel, message", [
    ("full:0", ParallelConfig(), "remat='full:0' is not a registered policy or block spec; valid: none, "),
    ("fulll:2", ParallelConfig(), "or POLICY:N[+POLICY] (the first N layers of each chunk, e.g. full:4+none)"),
    ("full:2+full", ParallelConfig(), "remat='full:2+full' puts every layer under 'full': write remat='full'"),
    ("full:9", ParallelConfig(), "remat='full:9': 9 layers under 'full', but a chunk (the stack, or L/(p·v) layers "
                                 "under a pipeline) has 8: N must be 1…8"),
    ("full:5", ParallelConfig(pipe=2), "has 4: N must be 1…4"),  # Megatron's N: per pipeline stage …
    ("full:3", ParallelConfig(pipe=2, schedule="interleaved", virtual_stages=2), "has 2: N must be 1…2"),  # … chunk
])
def test_a_bad_block_spec_is_one_line(remat, parallel, message):
    with pytest.raises(ConfigError) as e:
        validate(replace(preset("tiny"), layers=8), parallel, remat)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_block_spec_counts_its_layers_per_chunk_as_megatron():
    validate(replace(preset("tiny"), layers=8), ParallelConfig(pipe=2), "full:4")  # all of a stage: allowed
    assert segments("full:3+selective", 4) == [("full", 3), ("selective", 1)]
    assert segments("full:4", 4) == [("full", 4)] and segments("lean", 4) == [("lean", 4)]
    # 8 layers in p·v = 4 chunks of 2: 1 under full in each
    assert layer_counts("full:1", 8, chunks=4) == {"full": 4, "none": 4}
    cfg = preset("gpt3-1.3b")
    replays = lambda remat: F.train_flops(cfg, 1, remat) - F.train_flops(cfg, 1)
    assert F.train_flops(cfg, 1, "full:6+selective", chunks=2) == pytest.approx(
        F.train_flops(cfg, 1) + (12 * replays("full") + 12 * replays("selective")) / cfg.layers)


@pytest.mark.slow
def test_each_segment_stores_what_its_policy_stores():
    """`full:2` of 6 layers (t = 4 + SP): two forward layer loops, 2 layers storing what `full` stores per layer and
    4 what `none` stores (each per layer from its own policy's program), and the replays of 2 layers of `full`."""
    cfg = replace(MEMORY_CFG, layers=6)
    text = hlo("full:2", True, cfg=cfg)
    forward = {n: [l for l in hlo_loops.layer_loops(parse_hlo(text), n) if not l.backward] for n in (2, 4)}
    written = {n: sum(array_bytes(dt, dims) for loop in loops for dt, dims in loop.written)
               for n, loops in forward.items()}
    per_layer = {p: hlo_loops.stored_bytes_per_layer(hlo(p, True), MEMORY_CFG.layers) for p in ("full", "none")}
    assert written == {2: 2 * per_layer["full"], 4: 4 * per_layer["none"]}
    flops = {p: dot_flops(hlo(p, True, cfg=cfg)) for p in ("none", "full", "full:2")}
    assert flops["full:2"] - flops["none"] == pytest.approx((flops["full"] - flops["none"]) * 2 / 6, rel=1e-9)
    assert layer_counts("full:2", 6) == {"full": 2, "none": 4}


def dot_flops(text: str) -> float:
    """The program's matmul FLOPs, each layer loop × its trip count (cost_analysis() counts a loop body once)."""
    return hlo_flops.dot_flops(parse_hlo(text), entry_name(text))


@pytest.mark.slow
def test_block_recompute_computes_what_none_computes():
    """Loss and every gradient, dropout on, data 2 × tensor 4 + SP: a block spec changes what is kept, not a value."""
    cfg = replace(preset("tiny"), layers=4, dtype="float32", dropout=0.1)
    params = M.init_params(jax.random.key(1), cfg, tensor=4)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, cfg.seq_len + 1), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    parallel = ParallelConfig(data=2, tensor=4, sequence_parallel=True)
    layout = Layout(cfg, parallel, make_mesh(parallel, jax.devices()))
    (loss, grads), (ref_loss, ref_grads) = (T.make_loss_and_grad(layout, remat)(params, batch, jax.random.key(2))
                                            for remat in ("full:1+lean", "none"))
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    for g, r in zip(jax.tree.leaves(comparable(jax.device_get(grads))),
                    jax.tree.leaves(comparable(jax.device_get(ref_grads)))):
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-5 * np.max(np.abs(r)))


# float32 (XLA:CPU's bf16 temporaries are not a GPU's), as tests/test_plan.py's whole-model peak
PLAN_CFG = ModelConfig(vocab_size=1500, seq_len=128, hidden=64, heads=8, layers=6, dtype="float32", dropout=0.1)


@pytest.fixture(scope="module")
def rows():
    """The plan's `none` and `full` rows at t = 4 + SP for 6 layers (each measured at 2, as `plan` does)."""
    compiler = measure.Compiler(PLAN_CFG, 2, jax.devices())
    specs = [measure.RowSpec(f"tp+sp+{remat}", remat, True, 4, None) for remat in ("none", "full")]
    measured = [compiler.measure(spec) for spec in specs]
    state = memory.state_bytes(PLAN_CFG, 4)
    made = [P.make_row(PLAN_CFG, spec, m, 2, PLAN_CFG.layers, measured[0].flops_per_layer, state)
            for spec, m in zip(specs, measured)]
    return P.Plan("small", PLAN_CFG, 4, 2, made, P.formula_flops_per_layer(PLAN_CFG, 2, 4),
                  compiler.forward_flops_per_layer(4), 0.0,
                  parameters_per_device=memory.parameter_elements_per_device(PLAN_CFG, 4)[0])


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_the_composed_block_row_is_the_compiled_steps_peak_with_xla_cpus_copy_of_the_weights(rows, n):
    """The plan's block row (`recommend.block_row`, from its `full` and `none` rows) against memory_analysis() of the
    real 6-layer float32 train step compiled with `full:n`: above it by one copy of the layers' weights, which XLA:CPU
    makes to split the stack (`model.split_layers`); a bf16 step casts the masters into the two parts, and the H100's
    program is the composed row's (tests/test_gpu_target.py). A one-layer segment (n = 1 or 5 here) is outside this:
    without a loop XLA:CPU's scheduler moves its recompute, as it does unrolled layers' (config refuses those)."""
    row = block_row(rows, rows.row("tp+sp+full"), rows.row("tp+sp+none"), n)
    parallel = ParallelConfig(tensor=4, sequence_parallel=True)
    ma = aot.compile_train_step(PLAN_CFG, parallel, f"full:{n}", make_mesh(parallel, jax.devices()[:4]),
                                2).memory_analysis()
    compiled_peak = ma.argument_size_in_bytes + ma.temp_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
    state = memory.state_bytes_by_part(PLAN_CFG, 4)
    assert row.remat == f"full:{n}+none"
    assert 0 < compiled_peak - row.total_bytes_per_device <= 1.1 * state["layers"].params, (row, compiled_peak)


@pytest.mark.slow
def test_a_budget_between_none_and_full_recommends_the_fewest_full_layers_that_fit(rows):
    none, full = rows.row("tp+sp+none"), rows.row("tp+sp+full")
    blocks = [block_row(rows, full, none, n) for n in range(1, 6)]
    budget = (blocks[1].total_bytes_per_device + blocks[2].total_bytes_per_device) / 2  # n = 3 fits, 2 does not
    chosen, rejected = recommend(rows, budget)
    assert chosen.remat == "full:3+none" and chosen.total_bytes_per_device == blocks[2].total_bytes_per_device
    assert none.recompute_overhead_pct < chosen.recompute_overhead_pct < full.recompute_overhead_pct
    assert [r.config for r, _ in rejected] == ["tp+sp+none"]
    text = report.format_recommendation(rows, budget / 2**30)
    assert "train with --remat full:3+none" in text and "--recompute-num-layers 3" in text
    assert recommend(rows, none.total_bytes_per_device)[0].remat == "none"  # what fits needs no block


def test_the_search_adds_each_unfitting_policys_fewest_full_layers_that_fit():
    """`plan --search --block-recompute` on tests/test_search.py's hand costs: every block it adds is a configuration
    that does not fit under its policy and fits under full, with the fewest full layers per chunk that fit
    (`search_memory.block_memory`, the plan's composition), priced between the two (`search_time.block_time`)."""
    from dataclasses import replace as swap

    from jaxseq.planning.costs import costs_of
    from jaxseq.planning.search import evaluate, search
    from jaxseq.planning.search_memory import block_memory
    from jaxseq.remat import block_spec
    from test_search import CFG as SEARCH_CFG, NODE, HandCosts, request

    costs = HandCosts()
    r = request(hardware=swap(NODE, memory_gib=0.15), block_recompute=True)
    res = search(SEARCH_CFG, r, costs)
    blocks = [e for e in res.ranked if block_spec(e.candidate.remat)]
    assert blocks and all(e.memory.total_bytes <= r.budget_bytes for e in blocks)
    for e in blocks:
        first, n, rest = block_spec(e.candidate.remat)
        k = SEARCH_CFG.layers // (e.candidate.pipe * e.candidate.virtual)
        plain = {p: evaluate(SEARCH_CFG, r, swap(e.candidate, remat=p), costs) for p in (first, rest)}
        assert first == "full" and plain["full"].fits and not plain[rest].fits and 1 <= n < k
        stored = costs_of(SEARCH_CFG, plain[rest].candidate, costs)[0].stored_bytes
        fewer = (block_memory(plain[rest].memory, plain["full"].memory, stored, n - 1, k) if n > 1
                 else plain[rest].memory)
        assert fewer.total_bytes > r.budget_bytes
        assert plain[rest].time.total_s <= e.time.total_s <= plain["full"].time.total_s or \
            plain["full"].time.total_s <= e.time.total_s <= plain[rest].time.total_s
        assert e.time.compute_s == pytest.approx(plain[rest].time.compute_s
                                                 + n / k * (plain["full"].time.compute_s - plain[rest].time.compute_s))
    with pytest.raises(ConfigError, match="block recompute runs some layers under full: add full"):
        search(SEARCH_CFG, request(remats=("none", "selective"), block_recompute=True), costs)


@pytest.mark.slow
def test_with_a_target_the_recommended_block_is_compiled_as_it_would_run(rows, monkeypatch, capsys):
    """`plan --target h100 --budget-gib B`: a recommended block spec (composed from two rows) is then compiled as a
    whole train step for the GPU, its peak printed beside the composed row's (the compile itself stands in here; the
    H100's program against the composition: tests/test_gpu_target.py)."""
    from jaxseq import plan as plan_command
    from jaxseq.planning import gpu_target

    none, full = rows.row("tp+sp+none"), rows.row("tp+sp+full")
    budget = block_row(rows, full, none, 3).total_bytes_per_device
    asked = []
    monkeypatch.setattr(plan_command, "plan", lambda *a, **k: rows)
    monkeypatch.setattr(plan_command, "format_table", lambda p: "")  # the paper's rows' table: not these two
    monkeypatch.setattr(gpu_target, "step_bytes", lambda cfg, parallel, remat, b, m, target: asked.append(
        (cfg, parallel, remat, b, m, target)) or 12345 * 2**20)
    argv = ["--tensor", "4", "--micro-batch-size", "2", "--target", "h100", "--budget-gib", str(budget / 2**30)]
    assert plan_command.main(argv) == 0
    assert ("its whole train step compiled for the h100 with --remat full:3+none: 12.1 GiB per device (over the "
            "budget") in capsys.readouterr().out
    (cfg, parallel, remat, b, m, target), = asked
    assert (cfg, remat, b, m, target) == (PLAN_CFG, "full:3+none", 2, 1, "h100")
    assert (parallel.tensor, parallel.sequence_parallel, parallel.num_devices) == (4, True, 4)
    assert plan_command.main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)["budget"]
    assert (out["recommended_remat"], out["recommended_compiled_bytes_per_device"]) == ("full:3+none", 12345 * 2**20)
