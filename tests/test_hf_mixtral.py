"""The mixture-of-experts family against `transformers`' MixtralForCausalLM (the outside reference), through jaxseq's
converter (interop/hf_mixtral.py): a random model of an odd shape (vocabulary 300, 4 query heads over 2 K/V heads,
4 experts of width 48, top-2, RMSNorm scales not all ones), no token dropped (Mixtral routes dropless).
- logits equal transformers' (relative ≤ 1e-5);
- each layer's load-balancing loss equals transformers' `load_balancing_loss_func` of that layer's router logits;
- the loss (cross-entropy + coefficient × each layer's balancing loss) and the gradient of every parameter equal
  PyTorch autograd's (relative ≤ 1e-5 per parameter);
- from-hf → to-hf gives back every tensor exactly, and transformers loads it with the same logits;
- what Mixtral cannot hold or jaxseq cannot compute is refused in one line.
transformers' own `aux_loss` pools every layer's router logits into one balancing loss (the counts and probabilities
summed over layers before their product); jaxseq's, as Megatron-LM's, adds each layer's: equal for one layer, and
each layer's is compared here. Without torch/transformers these tests fail (an import error), never skip."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

try:
    import torch
    import transformers
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
except ImportError as e:  # the outside reference: fail, never skip
    raise ImportError(f"{e}; the comparisons with transformers need `pip install -r requirements-test.txt`") from e
from safetensors.numpy import load_file  # noqa: E402

import hf_moe  # noqa: E402
from jaxseq import convert  # noqa: E402
from jaxseq.config import ARCHITECTURE_FIELDS, ConfigError, replace  # noqa: E402
from jaxseq.presets import preset  # noqa: E402
from jaxseq.interop import hf_mixtral  # noqa: E402
from jaxseq.models import experts, moe  # noqa: E402
from jaxseq.training import conversion  # noqa: E402

VOCAB, HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, EXPERTS, TOP_K, SEQ = 300, 64, 4, 2, 48, 2, 4, 2, 32
COEF = 0.02
TOLERANCE = 1e-5
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, SEQ + 1)).astype(np.int32)


def mixtral(seed: int = 0):
    """A random float32 MixtralForCausalLM whose norms are not all ones."""
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                        num_key_value_heads=KV_HEADS, intermediate_size=FFN, num_hidden_layers=LAYERS,
                                        num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                        max_position_embeddings=SEQ, rms_norm_eps=1e-5, router_aux_loss_coef=COEF,
                                        bos_token_id=1, eos_token_id=2, pad_token_id=None)  # no padding row
    return hf_moe.with_norms_perturbed(transformers.MixtralForCausalLM(config))


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    hf = mixtral()
    path = tmp_path_factory.mktemp("hf") / "mixtral"
    hf.save_pretrained(path, safe_serialization=True)
    return hf, str(path)


@pytest.fixture(scope="module")
def loaded(hf_model):
    return hf_moe.load_padded(hf_model[1])


def test_the_converted_config_is_mixtrals(loaded):
    cfg = loaded[0]
    assert (cfg.family, cfg.moe_experts, cfg.moe_top_k, cfg.mlp_hidden, cfg.moe_capacity_factor, cfg.moe_norm_topk,
            cfg.moe_aux_loss_coef, cfg.num_kv_heads) == ("moe", EXPERTS, TOP_K, FFN, None, True, COEF, KV_HEADS)


def test_logits_and_each_layers_balancing_loss_match_transformers(hf_model, loaded):
    cfg, params = loaded
    inputs = TOKENS[:, :-1]
    with torch.no_grad():
        out = hf_model[0](torch.tensor(inputs, dtype=torch.long), output_router_logits=True)
    logits = conversion.logits(params, inputs, cfg)
    np.testing.assert_allclose(logits, out.logits.numpy(), rtol=0, atol=TOLERANCE * np.abs(out.logits.numpy()).max())
    router = np.asarray(moe.routing(params, jnp.asarray(inputs), cfg)).reshape(LAYERS, -1, EXPERTS)
    for layer in range(LAYERS):
        np.testing.assert_allclose(router[layer], out.router_logits[layer].numpy(), rtol=0, atol=1e-5)
        probs, choices, _ = experts.route(jnp.asarray(router[layer]), cfg)
        ours = experts.load_balancing_loss(probs.sum(0), experts.assignments(choices, EXPERTS), router.shape[1],
                                           EXPERTS)
        theirs = load_balancing_loss_func((out.router_logits[layer],), EXPERTS, TOP_K).item()
        assert abs(float(ours) - theirs) <= TOLERANCE * theirs, (layer, float(ours), theirs)


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
    for name, t in src.items():
        assert dst[name].dtype == t.dtype and np.array_equal(dst[name], t), name
    again = transformers.MixtralForCausalLM.from_pretrained(back).eval()
    with torch.no_grad():
        tokens = torch.tensor(TOKENS, dtype=torch.long)
        np.testing.assert_array_equal(again(tokens).logits.numpy(), hf_model[0](tokens).logits.numpy())


def test_a_mixture_trained_in_jaxseq_gets_a_config_that_reads_back_as_itself():
    cfg = preset("tiny-moe")
    back = hf_mixtral.model_config(json.loads(json.dumps(hf_mixtral.hf_config(cfg))))
    assert {f: getattr(back, f) for f in ARCHITECTURE_FIELDS} == {f: getattr(cfg, f) for f in ARCHITECTURE_FIELDS}


@pytest.mark.parametrize("changes, message", [
    ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported by jaxseq"),
    ({"sliding_window": 4096}, "sliding_window=4096 (only null) is not supported"),
])
def test_what_jaxseq_cannot_compute_is_refused_in_one_line(hf_model, changes, message):
    config = {**json.load(open(os.path.join(hf_model[1], "config.json"))), **changes}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        hf_mixtral.model_config(config)
    assert "\n" not in str(e.value)


def test_what_mixtral_cannot_hold_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="moe_shared_experts=1: Mixtral has no shared experts"):
        hf_mixtral.hf_config(replace(preset("tiny-moe"), moe_shared_experts=1))
