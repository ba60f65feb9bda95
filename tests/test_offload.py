"""Host offload (`--offload NAMES`, `--offload-optimizer`; jaxseq/offload.py) on 8 simulated CPU devices: a request
is checked once, in one line; the same loss and every gradient with the stored tensors offloaded as without, under
TP + SP, FSDP with block recompute, the ring context and a 1F1B pipeline (whose stash then waits in host memory);
the train command with both offloads, resumed, sampled from. Where the bytes go is the GPU program's to say:
tests/test_gpu_target.py."""

import jax
import numpy as np
import pytest

from commands import command
from jaxseq import offload as O
from jaxseq import train
from jaxseq import generate
from jaxseq.config import ParallelConfig, replace
from jaxseq.presets import preset
from jaxseq.mesh import make_mesh
from jaxseq.models import model as M
from jaxseq.parallel import pipeline as PL
from jaxseq.parallel.layout import Layout
from jaxseq.remat import EVERYTHING, LEAN, MOE
from jaxseq.training import train_step as T
from trees import comparable

CFG = replace(preset("tiny"), dtype="float32", dropout=0.1)


@pytest.mark.parametrize("text, remat, cfg, message", [
    ("attn_probs", "selective", CFG, "offload='attn_probs' is not a tensor remat='selective' stores here; valid: all"),
    ("contxt", "lean", CFG, "offload='contxt' is no checkpoint name; valid: all, or any of decoder_layer_input, "
                            "query_proj, key_proj, value_proj, context, mid_layer_residual, mlpwi"),
    ("mlp_dropout_mask", "none", replace(CFG, dropout=0.0), "is not a tensor remat='none' stores here"),  # no dropout
    ("attn_probs", "none", replace(CFG, attention="fused"), "is not a tensor remat='none' stores here"),  # no scores
    ("mlpwi", "full", CFG, "valid: all, or any of decoder_layer_input"),
])
def test_an_offload_the_policy_does_not_store_is_one_line(text, remat, cfg, message):
    with pytest.raises(ValueError) as e:
        O.resolve(text, remat, M.tagged_names(cfg))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_all_is_what_each_policy_stores_that_the_model_makes():
    tagged = M.tagged_names(CFG)
    dense = tuple(n for n in EVERYTHING if n not in MOE)  # a dense model tags no mixture-of-experts tensor
    assert O.resolve("all", "none", tagged) == dense[:6] + dense[7:]  # no cuDNN statistics on XLA's
    assert set(O.resolve("all", "lean", tagged)) == set(LEAN) - {"attn_softmax_stats", *MOE}
    assert O.resolve("all", "full", tagged) == ("decoder_layer_input",)
    assert O.resolve("all", "full:1+lean", tagged) == O.resolve("all", "lean", tagged)  # both segments' names
    assert O.resolve("context, mlpwi", "lean", tagged) == ("context", "mlpwi")
    assert "attn_probs" not in O.resolve("all", "none", M.tagged_names(replace(CFG, attention="fused")))


def test_a_gpu_layers_names_are_known_without_cudnn():
    """A plan or search for a GPU asks what a layer under cuDNN's attention tags on a machine without cuDNN (`plan
    --search --attention fused --offload all` ended in cuDNN's RuntimeError): XLA's kernel's names and the
    statistics cuDNN's VJP keeps (tests/test_gpu_offload.py holds them to the cuDNN layer's, traced where it can)."""
    gpu = replace(CFG, attention="fused", fused_kernel="cudnn", dtype="bfloat16", dropout=0.0)
    names = M.tagged_names(gpu)
    assert names == M.tagged_names(replace(gpu, fused_kernel="xla")) | {"attn_softmax_stats"}
    assert "context" in names and "attn_softmax_stats" in O.resolve("all", "lean", names)


def test_the_train_command_refuses_a_bad_offload_in_one_line():
    done = command(train.main, "--preset", "tiny", "--remat", "lean", "--offload", "attn_probs", "--steps", "1",
                   check=False)
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: offload='attn_probs' is not a tensor remat='lean' stores here; valid: all, "
                                   "or any of decoder_layer_input, query_proj, key_proj, value_proj, context, "
                                   "mid_layer_residual, mlpwi")


def _batch():
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (8, CFG.seq_len + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _loss_and_grads(parallel: ParallelConfig, remat: str, offload: tuple[str, ...], microbatches: int = 1, cfg=CFG):
    params = M.init_params(jax.random.key(1), cfg, tensor=parallel.tensor)
    layout = Layout(cfg, parallel, make_mesh(parallel, jax.devices()[: parallel.num_devices]))
    fn = (PL.make_loss_and_grad(layout, remat, microbatches, offload) if parallel.pipe > 1 else
          T.make_loss_and_grad(layout, remat, offload))
    loss, grads = fn(params, _batch(), jax.random.key(2))
    return float(loss), jax.device_get(grads)


@pytest.mark.slow
@pytest.mark.parametrize("parallel, remat, text, microbatches, cfg", [
    pytest.param(ParallelConfig(data=2, tensor=4, sequence_parallel=True), "selective", "all", 1, CFG, id="tp+sp"),
    pytest.param(ParallelConfig(fsdp=4, tensor=2, sequence_parallel=True), "full:1+lean", "all", 1, CFG,
                 id="fsdp+block"),
    pytest.param(ParallelConfig(data=2, context=2, tensor=2, sequence_parallel=True, context_strategy="ring"), "lean",
                 "context,mlpwi", 1, replace(CFG, dropout=0.0), id="ring"),
    pytest.param(ParallelConfig(pipe=2, data=2, tensor=2, sequence_parallel=True), "selective", "all", 4, CFG,
                 id="1f1b"),
])
def test_offloading_computes_the_same_loss_and_gradients(parallel, remat, text, microbatches, cfg):
    """float32, dropout on (but the ring's): loss and every gradient relative ≤ 1e-6 of the same policy without
    offload. Pairwise: offload with dropout in the other three layouts, the ring with dropout against context 1 in
    tests/test_context.py, and here the ring with offload without dropout (its dropout is most of the ring's
    compile: 15 s for the two programs with it, 6 s without)."""
    names = O.resolve(text, remat, M.tagged_names(cfg))
    assert names
    (loss, grads), (ref_loss, ref_grads) = (_loss_and_grads(parallel, remat, offload, microbatches, cfg)
                                            for offload in (names, ()))
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
    grads, ref_grads = comparable(jax.device_get(grads)), comparable(jax.device_get(ref_grads))
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        err = np.max(np.abs(g - r)) / np.max(np.abs(r))
        assert err <= 1e-6, f"{jax.tree_util.keystr(path)}: relative error {err:.2e}"


@pytest.mark.slow
def test_a_run_with_both_offloads_resumes_and_samples(tmp_path):
    """The train command with --offload all --offload-optimizer: its banner says what XLA:CPU does with it, its state
    is held in host memory (the memory kind on its checkpoint's restore target too), a resume continues it, and
    `generate` restores its weights."""
    run = str(tmp_path / "run")
    args = ("--preset", "tiny", "--steps", "2", "--batch-size", "8", "--log-every", "1", "--eval-every", "2",
            "--checkpoint-every", "2", "--run-dir", run, "sample_tokens=0")
    done = command(train.main, *args, "--offload", "all", "--offload-optimizer")
    assert "XLA:CPU JAX lowers the transfers to nothing" in done.stdout
    assert "master weights and Adam moments in host memory (pinned_host)" in done.stdout
    resumed = command(train.main, "--run-dir", run, "--resume", "--steps", "3", "sample_tokens=0")
    assert "step=3" in resumed.stdout + resumed.stderr
    assert "offload: decoder_layer_input, norm_stats" in resumed.stdout  # the saved, resolved names
    sampled = command(generate.main, "--run-dir", run, "--max-tokens", "4")
    assert sampled.stdout.startswith("# step 3")


def test_the_search_offers_offloading_where_a_configuration_does_not_fit():
    """`plan --search --offload all --offload-optimizer` on hand-set costs (tests/test_search.py's): each configuration
    over the budget under a plain policy gains its variants, composed from its evaluation: device memory less the
    formula's bytes per layer × the layers in flight (and the masters and moments during the loops), those in host
    memory, its time plus the PCIe seconds the overlap assumption charges; an offloaded `none` fits where `none` does
    not, and is ranked by that time."""
    from test_search import CFG as SEARCH_CFG, NODE, HandCosts, request
    from jaxseq.planning import host_tier
    from jaxseq.planning.search import search

    plain = search(SEARCH_CFG, request(hardware=replace(NODE, memory_gib=0.12)), HandCosts(), "hand")
    r = request(hardware=replace(NODE, memory_gib=0.12), offload=True, offload_optimizer=True)
    res = search(SEARCH_CFG, r, HandCosts(), "hand")
    by_label = {e.candidate.label(): e for e in res.ranked}
    base = {e.candidate.label(): e for e in plain.ranked}
    offloaded = [e for e in res.ranked if e.candidate.offload]
    assert offloaded and any(e.candidate.remat == "none" for e in offloaded)
    assert not any(e.candidate.remat == "none" and e.candidate.pipe == 1 and e.candidate.tensor == 1
                   for e in plain.ranked)
    e = next(e for e in offloaded if not e.candidate.offload_optimizer)
    c = e.candidate
    names = O.resolve("all", c.remat, M.tagged_names(SEARCH_CFG))
    per_layer = host_tier.bytes_per_layer(SEARCH_CFG, c.remat, names, c.micro_batch, c.tensor, c.sequence_parallel)
    assert e.memory.host_bytes == per_layer * e.memory.in_flight_layers > 0
    assert e.time.pcie_s >= 0 and e.time.total_s == sum(
        getattr(e.time, f) for f in ("compute_s", "tp_s", "p2p_s", "bubble_s", "dp_s", "context_s", "optimizer_s",
                                     "fsdp_s", "pcie_s"))
    assert [x.time.total_s for x in res.ranked] == sorted(x.time.total_s for x in res.ranked)
    assert set(base) <= set(by_label)  # what fit without offload is still there, unchanged


def test_the_plans_offloaded_rows_move_the_formulas_bytes_to_the_host(monkeypatch):
    """`plan --offload all --offload-optimizer` (the rows' layers measured alike, nothing compiled: test_plan.py's
    arithmetic-only compiler with layers larger than what they offload): each row keeps what its own policy stores in
    host memory, `host_tier.bytes_per_layer` × the layers in flight, and the float32 masters and moments; its device
    total falls by the same bytes; PCIe carries each layer's tensors out and back and the state in and out, at the
    hardware table's bandwidth × the link efficiency. A name no row stores is one line."""
    from test_plan import ArithmeticOnly
    from jaxseq.planning import host_tier, measure, report
    from jaxseq.planning import plan as P
    from jaxseq.planning.recommend import block_row

    class LargeLayers(ArithmeticOnly):
        def measure(self, c):
            return measure.Measured(2**30, 1e6, {}, 500)

    monkeypatch.setattr(P, "Compiler", LargeLayers)
    cfg, t = replace(preset("tiny"), dtype="bfloat16"), 2
    plain = P.plan(cfg, t, 2, jax.devices(), "tiny", policies=["lean"])
    p = P.plan(cfg, t, 2, jax.devices(), "tiny", policies=["lean"], offload="all", offload_optimizer=True,
               pcie_gb_per_s=64.0)
    for row, before in zip(p.rows, plain.rows):
        state = P.plan_state(cfg, row.tensor, 1, 1, False)
        names = O.resolve("all", row.remat, M.tagged_names(cfg))
        per_layer = host_tier.bytes_per_layer(cfg, row.remat, names, 2, row.tensor, row.sequence_parallel)
        held = state.params + state.optimizer
        assert row.offload == names and per_layer > 0
        assert row.host_bytes_per_device == per_layer * cfg.layers + held
        assert row.total_bytes_per_device == before.total_bytes_per_device - row.host_bytes_per_device
        assert row.pcie_bytes_per_step == 2 * per_layer * cfg.layers + 2 * held
        assert row.pcie_seconds_per_step == row.pcie_bytes_per_step / (64e9 * host_tier.PCIE_EFFICIENCY)
    first, rest = (next(r for r in p.rows if r.tensor == t and r.sequence_parallel and r.remat == name)
                   for name in ("full", "lean"))
    block = block_row(p, first, rest, 1)  # --budget-gib's block recompute: each segment offloads its own
    names = O.resolve("all", block.remat, M.tagged_names(cfg))
    chunk = host_tier.bytes_per_layer(cfg, block.remat, names, 2, t, True, chunk_layers=cfg.layers)
    assert block.host_bytes_per_device == pytest.approx(chunk * cfg.layers + held)
    out = p.to_json()
    assert out["host_tier"]["pcie_gb_per_s"] == 64.0 and "host_bytes_per_device" in out["rows"][0]
    assert "host bytes: the formula (planning/host_tier.py)" in report.format_table(p)
    with pytest.raises(ValueError) as e:
        P.plan(cfg, t, 2, jax.devices(), "tiny", policies=["lean"], offload="contxt")
    assert str(e.value).startswith("offload='contxt' is no tensor these rows' policies store here; valid: all, or")
