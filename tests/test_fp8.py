"""FP8 GEMMs (models/fp8.py, `--fp8`): the quantization, each GEMM of the custom VJP against a float64 reference of
the same quantization, the scales at the edges of the range, and the model's layers under tensor and sequence
parallelism against one device. What the program compiled for an H100 runs (cuBLASLt's FP8 GEMMs):
tests/test_gpu_target.py."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxseq.config import ConfigError, ModelConfig, ParallelConfig, on_platform, replace, validate
from jaxseq.presets import preset
from jaxseq.models import fp8, model  # model: registers the families `validate` checks
from trees import comparable

SPEC = "bsh,hf->bsf"  # a layer's matmul: activations [b, s, h] × a weight [h, f]
FORMS = ("einsum", "cpu-bf16")  # the GPU's (the dot XLA:GPU rewrites) and XLA:CPU's native bf16 dot


def _operands(dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 16, 64)) * 3.0
    w = rng.standard_normal((64, 32)) * 0.02
    dy = rng.standard_normal((2, 16, 32)) * 1e-3
    return tuple(jnp.asarray(a, dtype) for a in (x, w, dy))


def _exact(q, s) -> np.ndarray:
    """A quantized tensor's value in float64: q · s, exact."""
    return np.asarray(q.astype(jnp.float32), np.float64) * float(s)


def _dot_bound(a: np.ndarray, b: np.ndarray, spec: str) -> np.ndarray:
    """The float32 rounding a sum of k products can carry (k·eps · Σ|products|, Higham's γ_k bound), plus one
    rounding of the result."""
    k = a.size * b.size // np.einsum(spec, a, b).size
    eps = np.finfo(np.float32).eps
    return (k + 1) * eps * np.einsum(spec, np.abs(a), np.abs(b))


def test_quantize_rounds_to_the_nearest_fp8_value_under_a_power_of_two_scale():
    """q is x / s rounded to the nearest e4m3 (e5m2) value, as ml_dtypes rounds it from float64; s is the smallest
    power of two with amax / s ≤ the format's maximum."""
    x, _, dy = _operands(jnp.float32)
    for value, fmt in ((x, fp8.E4M3), (dy, fp8.E5M2)):
        q, s = fp8.quantize(value, fmt)
        s = float(s)
        top = float(ml_dtypes.finfo(fmt).max)
        amax = float(np.max(np.abs(np.asarray(value, np.float64))))
        assert np.log2(s) == round(np.log2(s)) and amax / s <= top < 2 * amax / s
        expected = (np.asarray(value, np.float64) / s).astype(fmt)
        np.testing.assert_array_equal(np.asarray(q).view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("form", FORMS)
def test_an_fp8_gemm_and_its_gradients_match_float64_of_the_same_quantization(form):
    """y = x·w, dx = dy·wᵀ and dw = xᵀ·dy from e4m3 x and w and e5m2 dy (float32 operands and results, so that the
    only rounding left is float32's): each within float32's rounding of a float64 GEMM of the same quantized values."""
    x, w, dy = _operands(jnp.float32)
    y, vjp = jax.vjp(lambda x, w: fp8.matmul(SPEC, x, w, form), x, w)
    dx, dw = vjp(dy)
    (xq, xs), (wq, ws), (gq, gs) = (fp8.quantize(x, fp8.E4M3), fp8.quantize(w, fp8.E4M3), fp8.quantize(dy, fp8.E5M2))
    x64, w64, g64 = _exact(xq, xs), _exact(wq, ws), _exact(gq, gs)
    for got, spec, a, b in ((y, SPEC, x64, w64), (dx, "bsf,hf->bsh", g64, w64), (dw, "bsh,bsf->hf", x64, g64)):
        err = np.abs(np.asarray(got, np.float64) - np.einsum(spec, a, b))
        assert got.dtype == jnp.float32 and np.all(err <= _dot_bound(a, b, spec)), (spec, float(err.max()))


def test_in_bfloat16_both_forms_round_the_float32_sum_once():
    """bf16 operands (the model's): each GEMM is the float64 one of the quantized values rounded once to bf16 (to the
    float32 sum's rounding), in the GPU's form and the CPU's alike."""
    x, w, dy = _operands(jnp.bfloat16)
    (xq, xs), (wq, ws) = fp8.quantize(x, fp8.E4M3), fp8.quantize(w, fp8.E4M3)
    exact = np.einsum(SPEC, _exact(xq, xs), _exact(wq, ws))
    ulp = np.abs(exact) * 2.0 ** -8  # bf16's 8 significant bits: half an ulp either side at most
    for form in FORMS:
        y = fp8.matmul(SPEC, x, w, form)
        err = np.abs(np.asarray(y.astype(jnp.float32), np.float64) - exact)
        assert y.dtype == jnp.bfloat16 and np.all(err <= ulp + _dot_bound(_exact(xq, xs), _exact(wq, ws), SPEC))


@pytest.mark.parametrize("value", [0.0, 1e-40, 1e30, float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)])
def test_scales_stay_finite_at_zero_and_at_large_inputs(value):
    """A zero tensor, a subnormal one and one at bf16's largest value: finite, positive scales, quantized values
    finite, and the GEMM's gradients finite (a large x's forward product is not: it overflows any format)."""
    x = jnp.full((2, 4, 8), value, jnp.float32)
    for fmt in (fp8.E4M3, fp8.E5M2):
        q, s = fp8.quantize(x, fmt)
        assert np.isfinite(float(s)) and float(s) > 0 and np.all(np.isfinite(np.asarray(q.astype(jnp.float32))))
    w, dy = jnp.full((8, 3), 0.5, jnp.float32), jnp.full((2, 4, 3), 1e-3, jnp.float32)
    _, vjp = jax.vjp(lambda x, w: fp8.matmul("bsh,hf->bsf", x, w), x, w)
    dx, _ = vjp(dy)
    assert np.all(np.isfinite(np.asarray(dx)))


def test_fp8_with_float32_is_one_line():
    with pytest.raises(ConfigError, match=r"^fp8=True with dtype='float32': FP8 GEMMs run in a bfloat16 model"):
        validate(ModelConfig(dtype="float32", fp8=True), ParallelConfig(), "none")
    validate(ModelConfig(dtype="bfloat16", fp8=True), ParallelConfig(), "none")


@pytest.mark.parametrize("args,message", [
    ([], "--fp8 without --target: FP8 GEMMs are the program of a GPU with FP8 tensor cores"),
    (["--target", "a100"], "--fp8 with --target a100: FP8 GEMMs are the program of a GPU with FP8 tensor cores"),
    (["--search", "--gpus", "8", "--global-batch", "16", "--hardware", "a100"], "--fp8 on the a100: it has no FP8 "
                                                                                  "tensor cores"),
])
def test_a_plan_with_fp8_where_no_fp8_gemm_runs_is_one_line(args, message):
    """`plan --fp8` on the CPU's program (emulated FP8) or an A100 (no FP8 tensor cores): one line, nothing compiled."""
    from commands import command
    from jaxseq import plan as plan_command

    out = command(plan_command.main, "--preset", "tiny", "--fp8", *args, check=False)
    assert out.returncode == 2 and out.stderr.startswith(f"error: {message}") and out.stderr.count("\n") == 1, out


def _loss_and_grads(cfg, parallel, devices):
    """The tiny model's loss and gradients on `devices` (the train step's own `make_loss_and_grad`)."""
    from jaxseq.mesh import make_mesh
    from jaxseq.parallel.layout import Layout
    from jaxseq.training import train_step

    params = model.init_params(jax.random.key(1), cfg, tensor=4)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, cfg.seq_len + 1), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    fn = train_step.make_loss_and_grad(Layout(cfg, parallel, make_mesh(parallel, devices)), "selective")
    loss, grads = fn(params, batch, jax.random.key(2))
    return float(loss), jax.device_get(grads)


def _relative(a: dict, b: dict) -> float:
    """The largest relative difference ‖a − b‖ / ‖b‖ over the gradients' leaves."""
    a, b = comparable(jax.device_get(a)), comparable(jax.device_get(b))
    return max(float(np.linalg.norm(x - y) / np.linalg.norm(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_ranks_quantize_each_tensor_by_its_whole_amax(devices):
    """An FP8 GEMM inside shard_map, x split over `data` by rows and w over `tensor` by columns (each output element's
    whole sum on one rank): the forward is one device's bit for bit and the gradients, summed over ranks, within
    float32's rounding of one device's. Only so if every rank scales by the whole tensor's amax: a power-of-two scale
    changes no FP8 rounding in the format's normal range, so one rank's rows here are 2¹⁶ times the other's, which
    puts the small ones among FP8's subnormals under the whole tensor's scale and not under their own."""
    from jax.sharding import PartitionSpec as P

    from jaxseq.mesh import make_mesh

    x, w, dy = _operands(jnp.float32)
    x = x * jnp.array([1.0, 2.0**16], jnp.float32)[:, None, None]  # the data ranks' rows
    w = w * jnp.repeat(jnp.array([1.0, 1.0, 1.0, 2.0**16], jnp.float32), w.shape[1] // 4)  # the tensor ranks' columns
    dy = dy * jnp.array([2.0**16, 1.0], jnp.float32)[:, None, None]
    mesh = make_mesh(ParallelConfig(data=2, tensor=4), devices[:8])
    spec = (P("data", None, None), P(None, "tensor"))

    def grads(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: fp8.matmul(SPEC, x, w, "cpu-bf16"), x, w)
        return (y, *vjp(dy))

    one = jax.jit(grads)(x, w, dy)
    many = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(*spec, P("data", None, "tensor")),
                                 out_specs=(P("data", None, "tensor"), *spec)))(x, w, dy)
    np.testing.assert_array_equal(np.asarray(many[0]), np.asarray(one[0]))
    for a, b in zip(many[1:], one[1:]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6 * float(np.abs(b).max()))


@pytest.mark.slow  # 39 s on a loaded 2-core machine: three tiny steps compiled
def test_the_fp8_model_under_tensor_and_sequence_parallelism_matches_one_device(devices):
    """data=2 × tensor=4 + SP against one device, the FP8 model's loss and gradients: the step lowers (its column-
    parallel matmuls in nested shard_maps inside a region manual over `data`: `fp8.scale`'s docstring), its loss is
    one device's, and its gradients are within FP8's own error of one device's (an operand a float32 sum order away
    from an FP8 rounding boundary rounds the other way: the FP8 model's gradients differ from one device's about as
    much as FP8's from bf16's; bf16's parallel gradients are 10× closer)."""
    cfg = on_platform(replace(preset("tiny"), vocab_size=250, dtype="bfloat16", fp8=True), "cpu")
    one = _loss_and_grads(cfg, ParallelConfig(), devices[:1])
    many = _loss_and_grads(cfg, ParallelConfig(data=2, tensor=4, sequence_parallel=True), devices[:8])
    bf16 = _loss_and_grads(replace(cfg, fp8=False), ParallelConfig(), devices[:1])
    fp8_error, parallel_error = _relative(one[1], bf16[1]), _relative(many[1], one[1])
    assert abs(many[0] - one[0]) <= 1e-4 * abs(one[0])
    assert 0.01 < fp8_error < 0.2 and parallel_error < 1.5 * fp8_error, (parallel_error, fp8_error)


# ---------------------------------------------------------------------------------------------
# The time model and the search (no program compiled: hand costs)


def test_the_time_model_prices_the_weight_gemms_at_the_fp8_peak_and_the_rest_in_bf16():
    """With `fp8` the four weight GEMMs of a layer and their gradients run at the FP8 peak × the compute efficiency ×
    FP8's relative efficiency, with 1-byte operands; the attention core and the LM head stay bf16 GEMMs."""
    from jaxseq.hardware import HARDWARE
    from jaxseq.planning import kernel_time

    hw, cfg = HARDWARE["h100"], preset("gpt3-1.3b")
    bf16, eight = kernel_time.forward_gemms(cfg, 4, 1), kernel_time.forward_gemms(replace(cfg, fp8=True), 4, 1)
    seconds = lambda g: kernel_time.gemm_seconds(g, hw, 2, 0.728, 0.88)
    for name, g in eight.items():
        weight = name in kernel_time.WEIGHT_GEMMS
        assert g.fp8 == weight and all(b.fp8 == weight for b in g.backward()) and not bf16[name].fp8
        expected = hw.peak_tflops / (hw.fp8_peak_tflops * kernel_time.FP8_RELATIVE_EFFICIENCY) if weight else 1.0
        assert seconds(g) / seconds(bf16[name]) == pytest.approx(expected), name  # compute-bound at these shapes
    assert not any(g.fp8 for g in kernel_time.head_gemms(replace(cfg, fp8=True), 4, 1))
    assert kernel_time.FP8_RELATIVE_EFFICIENCY == pytest.approx(0.914, abs=1e-3)


def test_each_context_rank_quantizes_its_whole_weights():
    """At context c a rank runs s/c of each layer's tokens but quantizes all its weights (e4m3, forward and backward:
    2 · (2e + 1) bytes a weight element): the FP8 layers' compute at c = 2 is half theirs at c = 1 plus half their
    weights' quantization, which the time model once divided by c with the per-token bytes."""
    from jaxseq.hardware import HARDWARE
    from jaxseq.planning.costs import LayerCost
    from jaxseq.planning.search_space import Candidate, TimeModel
    from jaxseq.planning.search_time import compute_seconds

    cfg = ModelConfig(family="llama", vocab_size=512, seq_len=256, hidden=256, heads=8, kv_heads=2, layers=4,
                      ffn_hidden=512, dtype="bfloat16", fp8=True)
    hw, tm = HARDWARE["h100"], TimeModel(scan_stacks=False)
    layer = LayerCost(0.0, {}, 0.0, 0.0)
    at = lambda context: compute_seconds(cfg, Candidate(1, 1, 1, 2 // context, 1, "none", False, False, 4, context),
                                         hw, tm, layer, 0.0)
    h, f, kv = cfg.hidden, cfg.mlp_hidden, cfg.num_kv_heads * cfg.head_dim
    weights = h * (h + 2 * kv) + h * h + h * 2 * f + f * h  # QKV, out, gate and up, down
    quantize = 2 * (2 * cfg.itemsize + 1) * weights  # bytes a layer
    hbm = tm.memory_efficiency * hw.hbm_gb_per_s * 1e9
    assert at(2) - at(1) / 2 == pytest.approx(cfg.layers * quantize / 2 / hbm, rel=1e-9)


class HandCosts:
    """Round per-layer costs (tests/test_search.py's kind), an FP8 layer's the same as bf16's: the search's FP8 memory
    is its compiled layer's, the same stored bytes under every whitelist policy."""

    def __init__(self):
        self.prepared = []

    def prepare(self, keys, micro_batches):
        self.prepared = list(keys)

    def layer(self, t, sp, remat, b, context=1, strategy="all-gather", fp8=False):
        from jaxseq.planning.costs import LayerCost

        return LayerCost(2e6 * b / t, {"all-reduce": 2e6 * b} if t > 1 else {}, 5e5 * b + 1e6, 2e6 * b / t)

    def state(self, stage, t, d, dist, p, f=1):
        from jaxseq.planning.costs import StateCost

        layers = stage.layers * 10_000_000 // t
        n = layers + 1_000_000
        master = 4 * n // (d if dist else 1)
        return StateCost(master + 4 * n + 2 * master + 2 * n, n, master, layers, 2 * n, 2 * layers)


def test_the_search_takes_fp8_as_a_dimension():
    """`plan --search --fp8`: every configuration twice, with bf16 and with FP8 weight GEMMs, FP8's faster by what its
    GEMMs save and labelled so; the FP8 layers prepared apart; an A100 (no FP8 tensor cores) refused in one line."""
    from jaxseq.hardware import HARDWARE
    from jaxseq.planning.search import search
    from jaxseq.planning.search_report import format_result, to_json
    from jaxseq.planning.search_space import Request, enumerate_candidates

    cfg = ModelConfig(vocab_size=512, seq_len=256, hidden=512, heads=8, layers=4, dtype="bfloat16", attention="fused")
    hw = replace(HARDWARE["h100"], memory_gib=80.0)
    r = Request(gpus=8, global_batch=16, hardware=hw, micro_batches=(2,), remats=("selective",), fp8=(False, True))
    both, bf16 = enumerate_candidates(cfg, r), enumerate_candidates(cfg, replace(r, fp8=(False,)))
    assert len(both) == 2 * len(bf16) and {c.fp8 for c in both} == {False, True}
    costs = HandCosts()
    res = search(cfg, r, costs, "test")
    assert any(len(k) == 6 and k[5] for k in costs.prepared) and any(len(k) == 5 for k in costs.prepared)
    by = {(e.candidate.tensor, e.candidate.pipe, e.candidate.sequence_parallel, e.candidate.distributed_optimizer,
           e.candidate.fp8): e for e in res.ranked}
    pairs = [(e, by[k[:4] + (True,)]) for k, e in by.items() if not k[4] and k[:4] + (True,) in by]
    assert pairs and all(fp8.time.compute_s < e.time.compute_s for e, fp8 in pairs)
    text = format_result(res)
    assert "GEMM" in text and " fp8 " in text and "FP8 peak 1979 TFLOP/s" in text
    assert to_json(res)["fp8"] == [False, True] and any(e["fp8"] for e in to_json(res)["ranked"])
    with pytest.raises(ConfigError, match=r"^--fp8 on the a100: it has no FP8 tensor cores"):
        search(cfg, replace(r, hardware=HARDWARE["a100"]), costs, "test")
