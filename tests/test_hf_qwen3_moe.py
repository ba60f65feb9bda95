"""The mixture-of-experts family with Qwen3's q/k norm against `transformers`' Qwen3MoeForCausalLM (the outside
reference), through jaxseq's converter (interop/hf_qwen3_moe.py): a random model of an odd shape (vocabulary 300,
4 query heads over 2 K/V heads of width 24 ≠ hidden/heads = 16, 4 experts of width 48, top-2 with the weights not
renormalised, `norm_topk_prob` false: Mixtral's test holds them renormalised; every norm's scales not ones), no
token dropped (Qwen3-MoE routes dropless).
- logits equal transformers' (relative ≤ 1e-5), on one device and on tensor=2 + SP (each rank normalising its heads);
- each layer's load-balancing loss equals transformers' `load_balancing_loss_func` of that layer's router logits;
- the loss (cross-entropy + coefficient × each layer's balancing loss) and the gradient of every parameter, the q/k
  norms' included, equal PyTorch autograd's (relative ≤ 1e-5 per parameter);
- from-hf → to-hf gives back every tensor exactly, and transformers loads it with the same logits;
- what Qwen3-MoE cannot hold or jaxseq cannot compute is refused in one line.
transformers' own `aux_loss` pools every layer's router logits into one balancing loss; jaxseq's, as Megatron-LM's,
adds each layer's (test_hf_mixtral.py says the same). Without torch/transformers these tests fail, never skip."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:
    import torch
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
except ImportError as e:  # the outside reference: fail, never skip
    raise ImportError(f"{e}; the comparisons with transformers need `pip install -r requirements-test.txt`") from e
from safetensors.numpy import load_file  # noqa: E402

import hf_moe  # noqa: E402
from jaxseq import convert  # noqa: E402
from jaxseq.config import ARCHITECTURE_FIELDS, ConfigError, ParallelConfig, replace  # noqa: E402
from jaxseq.interop import hf_mixtral, hf_qwen3_moe  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import experts, moe  # noqa: E402
from jaxseq.presets import preset  # noqa: E402
from jaxseq.training import conversion  # noqa: E402

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, EXPERTS, TOP_K, SEQ = 300, 64, 4, 2, 24, 48, 2, 4, 2, 32
COEF = 0.02
TOLERANCE = 1e-5
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, SEQ + 1)).astype(np.int32)


def qwen3_moe(seed: int = 0):
    """A random float32 Qwen3MoeForCausalLM whose norms (the q/k norms too) are not all ones."""
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, intermediate_size=96, moe_intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=False, max_position_embeddings=SEQ,
        rms_norm_eps=1e-5, router_aux_loss_coef=COEF, bos_token_id=1, eos_token_id=2, pad_token_id=None)
    return hf_moe.with_norms_perturbed(transformers.Qwen3MoeForCausalLM(config))


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    hf = qwen3_moe()
    path = tmp_path_factory.mktemp("hf") / "qwen3_moe"
    hf.save_pretrained(path, safe_serialization=True)
    return hf, str(path)


@pytest.fixture(scope="module")
def loaded(hf_model):
    return hf_moe.load_padded(hf_model[1])


@pytest.fixture(scope="module")
def reference_out(hf_model):
    with torch.no_grad():
        return hf_model[0](torch.tensor(TOKENS[:, :-1], dtype=torch.long), output_router_logits=True)


def test_the_converted_config_is_qwen3_moes(loaded):
    cfg = loaded[0]
    assert (cfg.family, cfg.qk_norm, cfg.head_dim, cfg.moe_experts, cfg.moe_top_k, cfg.mlp_hidden,
            cfg.moe_capacity_factor, cfg.moe_norm_topk, cfg.moe_aux_loss_coef, cfg.num_kv_heads) == (
        "moe", True, HEAD_DIM, EXPERTS, TOP_K, FFN, None, False, COEF, KV_HEADS)


@pytest.mark.parametrize("layout", ["one device", "tensor=2+sp"])
def test_logits_match_transformers(loaded, reference_out, devices, layout):
    cfg, params = loaded
    mesh = None if layout == "one device" else make_mesh(ParallelConfig(tensor=2, sequence_parallel=True), devices[:2])
    logits = conversion.logits(params, TOKENS[:, :-1], cfg, mesh, sequence_parallel=mesh is not None)
    want = reference_out.logits.numpy()
    np.testing.assert_allclose(logits, want, rtol=0, atol=TOLERANCE * np.abs(want).max())


def test_each_layers_balancing_loss_matches_transformers(loaded, reference_out):
    cfg, params = loaded
    router = np.asarray(jax.jit(lambda p, t: moe.routing(p, t, cfg))(params, jnp.asarray(TOKENS[:, :-1])))
    router = router.reshape(LAYERS, -1, EXPERTS)
    for layer in range(LAYERS):
        np.testing.assert_allclose(router[layer], reference_out.router_logits[layer].numpy(), rtol=0, atol=1e-5)
        probs, choices, _ = experts.route(jnp.asarray(router[layer]), cfg)
        ours = experts.load_balancing_loss(probs.sum(0), experts.assignments(choices, EXPERTS), router.shape[1],
                                           EXPERTS)
        theirs = load_balancing_loss_func((reference_out.router_logits[layer],), EXPERTS, TOP_K).item()
        assert abs(float(ours) - theirs) <= TOLERANCE * theirs, (layer, float(ours), theirs)


def test_the_routing_weights_are_transformers_not_renormalised(hf_model, loaded):
    """norm_topk_prob false: the k weights are the softmax's own (summing below 1), as transformers' router gives
    them, the same experts chosen in the same order."""
    gate = hf_model[0].model.layers[0].mlp.gate
    with torch.no_grad():
        logits, theirs, chosen = gate(torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(1)))
    _, choices, weights = experts.route(jnp.asarray(logits.numpy()), loaded[0])
    np.testing.assert_array_equal(choices, chosen.numpy())
    np.testing.assert_allclose(weights, theirs.numpy(), rtol=1e-6)
    assert float(jnp.max(jnp.sum(weights, -1))) < 0.999


@pytest.mark.slow  # the loss and gradients compiled on both sides (the logits stay in the fast tier)
def test_loss_and_every_gradient_match_pytorch(hf_model, loaded):
    """The loss (cross-entropy + COEF × each layer's balancing loss) and every gradient equal PyTorch's
    (tests/hf_moe.py)."""
    cfg, params = loaded
    hf_moe.assert_loss_and_every_gradient_match(hf_model[0], cfg, params, TOKENS, load_balancing_loss_func, COEF,
                                                TOLERANCE)


def test_round_trip_is_exact_and_loads_in_transformers(hf_model, tmp_path):
    converted, back = str(tmp_path / "converted"), str(tmp_path / "back")
    assert convert.main(["from-hf", hf_model[1], converted]) == 0
    assert convert.main(["to-hf", converted, back]) == 0
    src, dst = (load_file(os.path.join(d, "model.safetensors")) for d in (hf_model[1], back))
    assert list(dst) == list(src)
    assert any(name.endswith("self_attn.q_norm.weight") for name in src)
    for name, t in src.items():
        assert dst[name].dtype == t.dtype and np.array_equal(dst[name], t), name
    again = transformers.Qwen3MoeForCausalLM.from_pretrained(back).eval()
    with torch.no_grad():
        tokens = torch.tensor(TOKENS, dtype=torch.long)
        np.testing.assert_array_equal(again(tokens).logits.numpy(), hf_model[0](tokens).logits.numpy())


def test_a_qwen3_moe_trained_in_jaxseq_gets_a_config_that_reads_back_as_itself():
    cfg = preset("qwen3-30b-a3b")
    assert conversion.hf_format(cfg) == "qwen3_moe" and conversion.hf_format(preset("mixtral-8x7b")) == "mixtral"
    written = json.loads(json.dumps(hf_qwen3_moe.hf_config(cfg)))
    back = hf_qwen3_moe.model_config(written)
    assert {f: getattr(back, f) for f in ARCHITECTURE_FIELDS} == {f: getattr(cfg, f) for f in ARCHITECTURE_FIELDS}
    theirs = transformers.Qwen3MoeConfig(**{k: v for k, v in written.items() if k not in ("architectures",)})
    assert (theirs.num_experts, theirs.head_dim, theirs.moe_intermediate_size, theirs.norm_topk_prob) == (
        128, 128, 768, True)


@pytest.mark.parametrize("changes, message", [
    ({"mlp_only_layers": [1]}, "mlp_only_layers=[1] (dense layers among the experts'; only [])"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2 (dense layers among the experts'; only 1)"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window=true (only false)"),
])
def test_what_jaxseq_cannot_compute_is_refused_in_one_line(hf_model, changes, message):
    config = {**json.load(open(os.path.join(hf_model[1], "config.json"))), **changes}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")) as e:
        hf_qwen3_moe.model_config(config)
    assert "\n" not in str(e.value)


def test_what_each_format_cannot_hold_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="qk_norm=False: Qwen3-MoE has no shared experts, no aux-loss-free bias "
                                          "and always normalises each head's q and k"):
        hf_qwen3_moe.hf_config(preset("tiny-moe"))
    with pytest.raises(ConfigError, match="qk_norm=True: Mixtral has no shared experts"):
        hf_mixtral.hf_config(replace(preset("tiny-moe"), qk_norm=True))
