"""The mixture-of-experts family on one device (models/moe.py, models/experts.py): one expert equals the dense Llama
layer, the capacity drops the tokens the stated rule drops, the balancing terms' gradients are their losses', what
each remat policy keeps of a MoE layer, and the refusals of bad input."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

from jaxseq import remat
from jaxseq.config import ConfigError, ParallelConfig, validate
from jaxseq.presets import preset
from jaxseq.models import experts, llama, model, moe
from jaxseq.models.ops import rms_norm
from jaxseq.sharding import Sharder

CFG = dataclasses.replace(preset("tiny-moe"), dtype="float32")
NO_MESH = Sharder(None)


def _layer(cfg, key=0):
    return jax.tree.map(lambda a: a[0], model.init_params(jax.random.key(key), cfg)["layers"])


@pytest.mark.slow  # a layer run op by op (eager): many small compiles
def test_one_expert_top_1_without_dropping_is_the_dense_llama_layer_exactly():
    """Bit for bit but the down-projection's weight gradient, which is the dense one's to float32 rounding."""
    dense = dataclasses.replace(preset("tiny-llama"), dtype="float32", ffn_hidden=CFG.mlp_hidden)
    one = dataclasses.replace(CFG, moe_experts=1, moe_top_k=1, moe_capacity_factor=None)
    p = _layer(dense)
    mine = {**{k: v for k, v in p.items() if k != "mlp"}, "router": {"kernel": jnp.ones((CFG.hidden, 1))},
            "experts": {"wi": {"kernel": p["mlp"]["wi"]["kernel"][None]},
                        "wo": {"kernel": p["mlp"]["wo"]["kernel"][None]}}}
    x = jax.random.normal(jax.random.key(1), (2, CFG.seq_len, CFG.hidden))
    ref, ref_vjp = jax.vjp(lambda x, p: model.block(x, p, None, dense, NO_MESH), x, p)
    out, vjp = jax.vjp(lambda x, p: model.block(x, p, None, one, NO_MESH), x, mine)
    np.testing.assert_array_equal(out, ref)
    g = jax.random.normal(jax.random.key(2), x.shape)
    (dx_ref, dp_ref), (dx, dp) = ref_vjp(g), vjp(g)
    np.testing.assert_array_equal(dx, dx_ref)
    np.testing.assert_array_equal(dp["experts"]["wi"]["kernel"][0], dp_ref["mlp"]["wi"]["kernel"])
    # The one gradient whose dot contracts differently: the experts' [C, f]ᵀ[C, h] over the dispatched tokens, the
    # dense layer's over (b, s). XLA:CPU may block the two sums differently (it did on an AVX-512 machine, never on
    # the others): the same sum to float32 rounding, a few ulps of its largest entry.
    want = dp_ref["mlp"]["wo"]["kernel"]
    np.testing.assert_allclose(dp["experts"]["wo"]["kernel"][0], want, rtol=0,
                               atol=4 * np.finfo(np.float32).eps * float(np.abs(want).max()))
    np.testing.assert_array_equal(dp["attn"]["q"]["kernel"], dp_ref["attn"]["q"]["kernel"])


def _kept_by_the_rule(choices: np.ndarray, experts_: int, slots: int) -> np.ndarray:
    """[T, k] bool: the stated rule written out: each expert takes assignments in (choice, token) order, the first
    `slots` of them."""
    taken = np.zeros(experts_, int)
    kept = np.zeros(choices.shape, bool)
    for j in range(choices.shape[1]):
        for t in range(choices.shape[0]):
            e = choices[t, j]
            kept[t, j] = taken[e] < slots
            taken[e] += 1
    return kept


@pytest.mark.parametrize("slots", [1, 3, 6])
def test_an_expert_keeps_its_first_slots_assignments_by_choice_then_token(slots):
    rng = np.random.default_rng(slots)
    tokens, k, e = 24, 2, 4
    choices = np.stack([rng.permutation(e)[:k] for _ in range(tokens)])  # each token's k distinct experts
    slot = np.asarray(experts.assign_slots(jnp.asarray(choices), e, slots))
    kept = _kept_by_the_rule(choices, e, slots)
    np.testing.assert_array_equal(slot < e * slots, kept)
    assert sorted(slot[kept].tolist()) == sorted(set(slot[kept].tolist()))  # one assignment a slot
    assert np.all(slot[kept] // slots == choices[kept])  # in its own expert's slots
    counts = np.asarray(experts.assignments(jnp.asarray(choices), e))
    assert (~kept).sum() == np.asarray(experts.dropped(jnp.asarray(counts), slots)).sum() == np.maximum(
        np.bincount(choices.ravel(), minlength=e) - slots, 0).sum()


@pytest.mark.slow  # a layer run op by op (eager): many small compiles
def test_the_layer_drops_what_the_rule_drops():
    """A router that sends every token first to expert 0 and then to expert 1 + t mod 3 (its logits built from two
    features of the token: 1 and t mod 3), at a capacity of C = ceil(factor·T·k/E) slots: each token's output is
    the sum over its kept choices of weight × expert(token), and expert 0 keeps the first C tokens."""
    cfg = dataclasses.replace(CFG, moe_experts=4, moe_top_k=2, moe_capacity_factor=1.0, moe_aux_loss_coef=0.0)
    tokens, h = CFG.seq_len, CFG.hidden
    p = _layer(cfg)
    y = jax.random.normal(jax.random.key(3), (1, tokens, h))
    y = y.at[..., 0].set(1.0).at[..., 1].set(jnp.arange(tokens) % 3)
    router = np.zeros((h, 4), np.float32)
    router[0], router[1] = [8.0, 1.0, 0.0, -1.0], [0.0, -2.0, 1.0, 1.8]
    p = {**p, "router": {"kernel": jnp.asarray(router)}}
    out, _ = experts.moe(y, p, cfg, NO_MESH)

    x = np.asarray(y).reshape(tokens, h)
    logits = x @ router
    choices = np.argsort(-logits, axis=1)[:, :2]
    assert np.all(choices[:, 0] == 0) and np.array_equal(choices[:, 1], 1 + np.arange(tokens) % 3)
    slots = experts.capacity(tokens, cfg)
    assert slots == int(np.ceil(1.0 * tokens * 2 / 4))
    kept = _kept_by_the_rule(choices, 4, slots)
    assert np.array_equal(np.flatnonzero(~kept[:, 0]), np.arange(slots, tokens))  # expert 0: tokens past its C
    assert (~kept).sum() == np.maximum(np.bincount(choices.ravel(), minlength=4) - slots, 0).sum()
    probs = np.asarray(jax.nn.softmax(jnp.asarray(logits), axis=-1))
    weights = np.take_along_axis(probs, choices, 1)
    weights /= weights.sum(1, keepdims=True)
    wi, wo = np.asarray(p["experts"]["wi"]["kernel"]), np.asarray(p["experts"]["wo"]["kernel"])
    want = np.zeros((tokens, h), np.float32)
    for t, j in zip(*np.nonzero(kept)):
        gate, up = np.einsum("h,hcf->cf", x[t], wi[choices[t, j]])
        want[t] += weights[t, j] * (gate / (1 + np.exp(-gate)) * up) @ wo[choices[t, j]]
    np.testing.assert_allclose(np.asarray(out).reshape(tokens, h), want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # a layer run op by op (eager): many small compiles
def test_the_balancing_terms_gradients_are_their_losses_gradients():
    """The layer adds coef·(load-balancing loss) + coef_z·(z-loss) to the loss through their gradient alone: the
    gradient of a loss through the layer equals, with coefficients, the one without plus their gradients."""
    cfg = dataclasses.replace(CFG, moe_capacity_factor=None, moe_aux_loss_coef=0.3, moe_z_loss_coef=0.2)
    off = dataclasses.replace(cfg, moe_aux_loss_coef=0.0, moe_z_loss_coef=0.0)
    p = _layer(cfg)
    y = jax.random.normal(jax.random.key(4), (2, CFG.seq_len, CFG.hidden))
    g = jax.random.normal(jax.random.key(5), y.shape)

    def terms(p, y):
        logits = jnp.einsum("bsh,he->bse", y, p["router"]["kernel"]).reshape(-1, cfg.moe_experts)
        probs, choices, _ = experts.route(logits, cfg)
        balance = experts.load_balancing_loss(probs.sum(0), experts.assignments(choices, cfg.moe_experts),
                                              logits.shape[0], cfg.moe_experts)
        return 0.3 * balance + 0.2 * experts.z_loss(logits)

    grad = lambda c: jax.grad(lambda p, y: jnp.sum(experts.moe(y, p, c, NO_MESH)[0] * g), argnums=(0, 1))(p, y)
    (dp, dy), (dp_off, dy_off) = grad(cfg), grad(off)
    dp_terms, dy_terms = jax.grad(terms, argnums=(0, 1))(p, y)
    np.testing.assert_allclose(dy, dy_off + dy_terms, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dp["router"]["kernel"], dp_off["router"]["kernel"] + dp_terms["router"]["kernel"],
                               rtol=1e-5, atol=1e-7)


POLICY_KEEPS = {  # what each policy keeps of the MoE half of a layer (beyond the attention half's, Llama's)
    "none": set(remat.MOE) | {remat.MLPWI_INPUT, remat.MLP_ACTIVATION},
    "selective": set(remat.MOE) | {remat.MLPWI_INPUT, remat.MLP_ACTIVATION},
    "lean": {remat.MOE_LOADS, remat.MOE_DISPATCHED, remat.MOE_EXPERT_HIDDEN, remat.MOE_EXPERT_OUTPUT},
    "full": set(),
}


@pytest.mark.parametrize("policy", sorted(POLICY_KEEPS))
def test_each_policy_keeps_the_moe_tensors_it_names(policy):
    p = _layer(CFG)
    x = jax.random.normal(jax.random.key(6), (2, CFG.seq_len, CFG.hidden))
    body = jax.checkpoint(lambda x, p: model.block(x, p, None, CFG, NO_MESH),
                          policy=remat.remat_policy(policy).policy)
    named = {d.split("'")[1] for _, d in saved_residuals(body, x, p) if d.startswith("named")}
    moe_half = set(remat.MOE) | {remat.MLPWI_INPUT, remat.MLP_ACTIVATION}
    assert named & moe_half == POLICY_KEEPS[policy]


@pytest.mark.parametrize("changes, parallel, message", [
    ({"moe_top_k": 9}, {}, "moe_top_k=9 must be an integer from 1 to moe_experts=8"),
    ({}, {"expert": 3, "data": 1}, "expert=3 does not divide moe_experts=8"),
    ({"moe_capacity_factor": 0.0}, {}, "moe_capacity_factor=0.0 must be > 0"),
    ({"moe_capacity_factor": -1.5}, {}, "moe_capacity_factor=-1.5 must be > 0"),
    ({"moe_experts": 0}, {}, "moe_experts=0 must be a positive integer"),
])
def test_bad_input_is_refused_in_one_line(changes, parallel, message):
    with pytest.raises(ConfigError) as e:
        validate(dataclasses.replace(CFG, **changes), ParallelConfig(**parallel), "selective")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_expert_axis_needs_experts():
    with pytest.raises(ConfigError, match="expert=2 splits a mixture of experts' experts, and this model has none"):
        validate(preset("tiny-llama"), ParallelConfig(expert=2), "selective")


@pytest.mark.slow  # a layer run op by op (eager): many small compiles
def test_routing_reads_every_layers_router():
    params = model.init_params(jax.random.key(7), CFG)
    tokens = jax.random.randint(jax.random.key(8), (2, CFG.seq_len), 0, CFG.vocab_size)
    logits = moe.routing(params, tokens, CFG)
    assert logits.shape == (CFG.layers, 2, CFG.seq_len, CFG.moe_experts)
    first = jax.tree.map(lambda a: a[0], params["layers"])
    mid = llama.attention_half(moe.embed(params["embed"], tokens, None, CFG, NO_MESH), first, None, None, CFG, NO_MESH)
    want = jnp.einsum("bsh,he->bse", rms_norm(mid, first["mlp_norm"]["scale"], CFG.ln_eps), first["router"]["kernel"])
    np.testing.assert_allclose(logits[0], want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # a layer run op by op (eager): many small compiles
def test_the_aux_loss_free_bias_gradient_is_each_experts_load_above_its_share():
    """DeepSeek-V3's bias: the experts chosen by probability + bias, and the bias's gradient (which the optimizer
    moves it against by sign: training/train_step.make_optimizer) each expert's assignments less their mean."""
    cfg = dataclasses.replace(CFG, moe_bias_rate=0.01, moe_capacity_factor=None)
    params = model.init_params(jax.random.key(9), cfg)
    params["layers"]["router"]["bias"] = jax.random.normal(jax.random.key(10), (cfg.layers, cfg.moe_experts)) * 0.1
    tokens = jax.random.randint(jax.random.key(11), (2, cfg.seq_len), 0, cfg.vocab_size)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}
    grad = jax.grad(model.loss_fn)(params, batch, cfg, NO_MESH, "none")["layers"]["router"]["bias"]
    logits = moe.routing(params, tokens, cfg).reshape(cfg.layers, -1, cfg.moe_experts)
    for layer in range(cfg.layers):
        _, choices, _ = experts.route(logits[layer], cfg, params["layers"]["router"]["bias"][layer])
        counts = np.bincount(np.asarray(choices).ravel(), minlength=cfg.moe_experts)
        np.testing.assert_array_equal(grad[layer], counts - counts.mean())


@pytest.mark.parametrize("axis", ["expert", pytest.param("data", marks=pytest.mark.slow),
                                  pytest.param("context", marks=pytest.mark.slow)])
def test_a_bf16_mixture_sums_its_region_weights_gradients_in_float32(axis):
    """tiny-moe in bf16 (its preset) over 2 ranks of a token axis: the router's and experts' gradients, summed over
    the ranks inside the token region (weights each rank holds whole, or its experts' share whole over the other
    token axes), are summed in float32, as every gradient reduction is (test_bfloat16.py); and XLA:CPU compiles the
    step (it aborted promoting their bf16 sums, whose reductions carry a sharding constraint: `plan --preset tiny-moe
    --context 2` died with "Invalid binary instruction opcode copy")."""
    from jaxseq.mesh import make_mesh
    from jaxseq.training import aot

    cfg = preset("tiny-moe")
    assert cfg.dtype == "bfloat16"
    parallel = ParallelConfig(**{axis: 2})
    lowered = aot.lower_loss_and_grad(cfg, parallel, "selective", make_mesh(parallel, jax.devices()[:2]), 2)
    text = lowered.as_text()
    reduced = {}  # result shape → element types of its sums (JAX 0.10 and 0.12 print their replica groups apart)
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if '"stablehlo.all_reduce"' in line:
            dtype = re.search(r"tensor<(\w+)>", lines[i + 1]).group(1)  # the reducer's arguments
            end = next(later for later in lines[i + 1:] if later.lstrip().startswith("}) : (tensor<"))
            reduced.setdefault(re.match(r"\s*\}\) : \(tensor<([\dx]+)x\w+>", end).group(1), set()).add(dtype)
    h, e, f = cfg.hidden, cfg.moe_experts, cfg.mlp_hidden
    local = e // parallel.expert
    weights = {"router": f"{h}x{e}", "wi": f"{local}x{h}x2x{f}", "wo": f"{local}x{f}x{h}"}
    summed = {name: reduced.get(shape) for name, shape in weights.items()}
    if axis == "expert":  # the experts are split over `expert`: only the router is held whole there
        assert summed["router"] == {"f32"} and summed["wi"] is None and summed["wo"] is None, summed
    else:
        assert all(dtypes == {"f32"} for dtypes in summed.values()), summed
    lowered.compile()


@pytest.mark.slow  # two steps compiled on 4 devices
def test_block_recompute_of_a_mixture_on_expert_ranks_equals_no_recompute():
    """Megatron's block recompute (`--remat full:1+lean`: the first layer under `full`, the other under `lean`,
    two layer loops) composes with a MoE layer on expert = 2 × data = 2: the loss and every gradient equal `none`'s
    (float32, dropless, the balancing loss on)."""
    from jaxseq.mesh import make_mesh
    from jaxseq.parallel.layout import Layout
    from jaxseq.training import train_step

    cfg = dataclasses.replace(CFG, moe_capacity_factor=None, dropout=0.0)
    parallel = ParallelConfig(expert=2, data=2)
    layout = Layout(cfg, parallel, make_mesh(parallel, jax.devices()[:4]))
    params = model.init_params(jax.random.key(0), cfg, 1)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (4, cfg.seq_len + 1), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    run = lambda policy: train_step.make_loss_and_grad(layout, policy)(params, batch, jax.random.key(1))
    (loss, grads), (ref_loss, ref_grads) = run("full:1+lean"), run("none")
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-7)
