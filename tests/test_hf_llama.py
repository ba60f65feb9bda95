"""Llama interop (jaxseq.interop.hf_llama) against `transformers`: random LlamaForCausalLM checkpoints
(nothing downloaded) of an odd shape (vocab 300, hidden 64, 4 heads over 2 KV heads, MLP 96) read into
jaxseq's layout equal to torch's state dict, block by block; written back they are the same tensors,
and transformers loads them with the same logits.

Variants: RoPE θ 500000 in one file; llama3 RoPE scaling with head_dim 24 (≠ hidden/heads) over several
files (an index); bfloat16. Tied embeddings (Llama 3.2 1B/3B) are refused. transformers is the outside reference:
without torch/transformers these tests fail (an import error), never skip."""

import json
import os

import numpy as np
import pytest

try:
    import torch
    import transformers
except ImportError as e:  # the outside reference: fail, never skip
    raise ImportError(f"{e}; the comparisons with transformers need `pip install -r requirements-test.txt`") from e
from safetensors.torch import load_file  # noqa: E402

from jaxseq.training import conversion  # noqa: E402
from jaxseq.config import ConfigError  # noqa: E402
from jaxseq.interop import hf, hf_llama  # noqa: E402

VOCAB, HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 300, 64, 4, 2, 96, 2
LLAMA3 = dict(rope_type="llama3", rope_theta=500000.0, factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
VARIANTS = {
    "theta": dict(config=dict(rope_parameters=dict(rope_type="default", rope_theta=500000.0)), shard=None,
                  dtype=torch.float32),
    "llama3-sharded": dict(config=dict(rope_parameters=LLAMA3, head_dim=24), shard="40KB", dtype=torch.float32),
    "bf16": dict(config=dict(), shard=None, dtype=torch.bfloat16),
}
TOKENS = torch.tensor(np.random.default_rng(0).integers(0, VOCAB, (2, 16)))


def llama_config(**changes):
    kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
              intermediate_size=FFN, num_hidden_layers=LAYERS, max_position_embeddings=64, rms_norm_eps=1e-5)
    return transformers.LlamaConfig(**{**kw, **changes})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{variant: (model, directory)}: random Llamas whose RMSNorm scales are not all ones, saved as HF does."""
    out = {}
    for name, variant in VARIANTS.items():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(llama_config(**variant["config"])).eval()
        with torch.no_grad():
            for param_name, p in model.named_parameters():
                if "norm" in param_name:
                    p.add_(0.1 * torch.randn_like(p))
        model = model.to(variant["dtype"])
        path = tmp_path_factory.mktemp("hf") / name
        kw = {"max_shard_size": variant["shard"]} if variant["shard"] else {}
        model.save_pretrained(path, safe_serialization=True, **kw)
        assert os.path.isfile(path / hf.INDEX) == bool(variant["shard"])
        out[name] = model, str(path)
    return out


@pytest.fixture(params=list(VARIANTS))
def hf_model(request, saved):
    """(variant, model, directory) for each variant."""
    return request.param, *saved[request.param]


def jaxseq_layout(state: dict, head_dim: int) -> dict:
    """torch's state dict in jaxseq's Llama tree, written out independently of the converter."""
    h, a, k, d = HIDDEN, HEADS, KV_HEADS, head_dim
    s = {n: t.float().numpy() for n, t in state.items()}

    def stack(fn):
        return np.stack([fn(f"model.layers.{i}.") for i in range(LAYERS)])

    return {
        "embed": {"token": s["model.embed_tokens.weight"]},
        "layers": {
            "attn_norm": {"scale": stack(lambda b: s[b + "input_layernorm.weight"])},
            "attn": {"q": {"kernel": stack(lambda b: s[b + "self_attn.q_proj.weight"].T.reshape(h, a, d))},
                     "kv": {"kernel": stack(lambda b: np.stack([s[b + "self_attn.k_proj.weight"].T.reshape(h, k, d),
                                                                s[b + "self_attn.v_proj.weight"].T.reshape(h, k, d)],
                                                               axis=1))},
                     "out": {"kernel": stack(lambda b: s[b + "self_attn.o_proj.weight"].T.reshape(a, d, h))}},
            "mlp_norm": {"scale": stack(lambda b: s[b + "post_attention_layernorm.weight"])},
            "mlp": {"wi": {"kernel": stack(lambda b: np.stack([s[b + "mlp.gate_proj.weight"].T,
                                                               s[b + "mlp.up_proj.weight"].T], axis=1))},
                    "wo": {"kernel": stack(lambda b: s[b + "mlp.down_proj.weight"].T)}},
        },
        "final_norm": {"scale": s["model.norm.weight"]},
        "lm_head": {"kernel": s["lm_head.weight"]},
    }


def leaves(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def read(path):
    config, weights = hf_llama.read_dir(path)
    cfg = hf_llama.model_config(config)
    return config, cfg, *hf_llama.to_params(cfg, weights)


def test_model_config(hf_model):
    variant, model, path = hf_model
    _, cfg, _, record, _ = read(path)
    assert (cfg.family, cfg.vocab_size, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.layers, cfg.mlp_hidden) == (
        "llama", VOCAB, HIDDEN, HEADS, KV_HEADS, LAYERS, FFN)
    assert (cfg.seq_len, cfg.ln_eps, cfg.dropout) == (64, 1e-5, 0.0)
    assert cfg.head_dim == model.config.head_dim == (24 if variant == "llama3-sharded" else 16)
    assert cfg.kv_channels == (24 if variant == "llama3-sharded" else None)
    rope = model.config.rope_parameters
    assert cfg.rope_theta == rope["rope_theta"] == (10000.0 if variant == "bf16" else 500000.0)
    if variant == "llama3-sharded":
        assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                cfg.rope_original_positions) == ("llama3", 4.0, 1.0, 4.0, 16)
    else:
        assert cfg.rope_scaling is None
    assert "tied" not in record


def test_to_params_equals_the_state_dict(hf_model):
    """Every leaf equals torch's tensor in jaxseq's layout exactly, and so does every block of it (what a
    device's shard reads: heads, rows and the K/V, gate/up pairs split)."""
    variant, model, path = hf_model
    _, cfg, params, _, buffers = read(path)
    expected = dict(leaves(jaxseq_layout(model.state_dict(), cfg.head_dim)))
    got = dict(leaves(params))
    assert sorted(got) == sorted(expected) and buffers == {}
    rng = np.random.default_rng(1)
    for name, leaf in got.items():
        whole = leaf.whole()
        assert whole.dtype == np.float32 and whole.shape == expected[name].shape, name
        np.testing.assert_array_equal(whole, expected[name], err_msg=name)
        for _ in range(4):
            cuts = [sorted(rng.integers(0, n + 1, 2)) for n in leaf.shape]
            index = tuple(slice(lo, hi) for lo, hi in cuts)
            np.testing.assert_array_equal(leaf.read(index), expected[name][index], err_msg=f"{name}{index}")


@pytest.mark.parametrize("shard_bytes", [5 * 10**9, 40_000], ids=["one-file", "sharded"])
def test_round_trip_is_exact_and_loads_in_transformers(hf_model, tmp_path, shard_bytes):
    variant, model, path = hf_model
    config, cfg, params, record, buffers = read(path)
    params = {name: leaf.whole() for name, leaf in leaves(params)}
    params = _tree(params)
    tensors = hf_llama.from_params(cfg, params, record, buffers)
    out = str(tmp_path / "back")
    files = hf.write_dir(out, hf_llama.hf_config(cfg), tensors, max_shard_bytes=shard_bytes)
    assert (len(files) > 1) == (shard_bytes < 10**6)
    back = {}
    for name in files:
        back.update(load_file(os.path.join(out, name)))
    src = model.state_dict()
    assert set(back) == set(src)
    for name, t in back.items():
        assert t.dtype == src[name].dtype and torch.equal(t, src[name]), name

    loaded, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert loaded.config.rope_parameters == model.config.rope_parameters
    assert loaded.config.tie_word_embeddings == model.config.tie_word_embeddings
    assert loaded.config.head_dim == model.config.head_dim
    with torch.no_grad():
        want = model(TOKENS).logits.float()
        got = loaded.to(model.dtype).eval()(TOKENS).logits.float()
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def _tree(flat: dict) -> dict:
    tree = {}
    for name, value in flat.items():
        *path, last = name.split(".")
        node = tree
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
    return tree


def test_tied_embeddings_are_refused_in_one_line(tmp_path):
    """Llama 3.2 1B/3B's tie_word_embeddings=true: refused from config.json, before a weight is read (jaxseq's
    Llama has an untied lm_head; a copy of the embedding would train as a second V·h matrix)."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(llama_config(tie_word_embeddings=True)).save_pretrained(tmp_path / "tied")
    for read_it in (lambda: hf_llama.read_dir(str(tmp_path / "tied")),
                    lambda: conversion.read_hf(str(tmp_path / "tied"))):
        with pytest.raises(ConfigError) as e:
            read_it()
        assert str(e.value).startswith("config.json: tie_word_embeddings=true (Llama 3.2 1B/3B") and (
            "\n" not in str(e.value)), str(e.value)


def test_legacy_rope_spelling_reads_the_same():
    """transformers 4's config.json: rope_theta at the top, scaling in rope_scaling (rope_type, or `type`)."""
    new = llama_config(rope_parameters=LLAMA3, max_position_embeddings=64).to_dict()
    legacy = {k: v for k, v in new.items() if k != "rope_parameters"}
    scaling = {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
    want = hf_llama.model_config(new)
    assert want.rope_scaling == "llama3" and want.rope_theta == 500000.0
    assert hf_llama.model_config({**legacy, "rope_theta": 500000.0, "rope_scaling": scaling}) == want
    old_key = {**{k: v for k, v in scaling.items() if k != "rope_type"}, "type": "llama3"}
    assert hf_llama.model_config({**legacy, "rope_theta": 500000.0, "rope_scaling": old_key}) == want
    plain = hf_llama.model_config({**legacy, "rope_theta": 123.0, "rope_scaling": None})
    assert (plain.rope_scaling, plain.rope_theta) == (None, 123.0)


def test_written_config_is_what_transformers_writes():
    """hf_config's RoPE and shape fields equal those transformers' own LlamaConfig writes for the model."""
    ref = llama_config(rope_parameters=LLAMA3, head_dim=24).to_dict()
    cfg = hf_llama.model_config(ref)
    ours = hf_llama.hf_config(cfg)
    assert hf_llama.model_config(ours) == cfg
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
                "rope_parameters", "attention_bias", "mlp_bias", "tie_word_embeddings", "model_type"):
        assert ours[key] == ref[key], key
    assert transformers.LlamaConfig.from_dict(ours).rope_parameters == ref["rope_parameters"]


@pytest.mark.parametrize("change, named", [
    ({"model_type": "mistral"}, "model_type='mistral'"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"sliding_window": 4096}, "sliding_window=4096"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type='yarn'"),
    ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type='linear'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 2.0}}, "low_freq_factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"hidden_size": None}, "hidden_size"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings=true"),
])
def test_refusals_name_the_value(tmp_path, change, named):
    """Refused from config.json alone (the directory has no weights): one line naming the value."""
    config = {k: v for k, v in {**llama_config().to_dict(), **change}.items() if v is not None or k not in change}
    os.makedirs(tmp_path / "hf")
    json.dump(config, open(tmp_path / "hf" / "config.json", "w"))
    with pytest.raises(ConfigError) as e:
        hf_llama.read_dir(str(tmp_path / "hf"))
    assert named in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_refuses_weights_that_disagree_with_the_config(saved, tmp_path):
    """Shapes and names come from the headers and are checked before any weight is read."""
    path = saved["theta"][1]
    config, weights = hf_llama.read_dir(path)
    wider = hf_llama.model_config({**config, "intermediate_size": 128})
    with pytest.raises(ConfigError, match=r"down_proj.weight has shape \(64, 96\), config.json says \(64, 128\)"):
        hf_llama.to_params(wider, weights)
    deeper = hf_llama.model_config({**config, "num_hidden_layers": 3})
    with pytest.raises(ConfigError, match=r"no model.layers.2.self_attn.q_proj.weight \(num_hidden_layers=3"):
        hf_llama.to_params(deeper, weights)
    with pytest.raises(ConfigError, match="no lm_head.weight"):  # untied by config, yet no lm_head saved
        state = {k: v for k, v in load_file(os.path.join(path, hf.SINGLE)).items() if k != "lm_head.weight"}
        from safetensors.torch import save_file

        os.makedirs(tmp_path / "nohead")
        save_file(state, str(tmp_path / "nohead" / hf.SINGLE), metadata={"format": "pt"})
        json.dump(config, open(tmp_path / "nohead" / "config.json", "w"))
        cfg = hf_llama.model_config(config)
        hf_llama.to_params(cfg, hf_llama.read_dir(str(tmp_path / "nohead"))[1])
    state = load_file(os.path.join(path, hf.SINGLE))
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(HIDDEN)
    os.makedirs(tmp_path / "bias")
    from safetensors.torch import save_file

    save_file(state, str(tmp_path / "bias" / hf.SINGLE), metadata={"format": "pt"})
    json.dump(config, open(tmp_path / "bias" / "config.json", "w"))
    with pytest.raises(ConfigError, match="q_proj.bias, which jaxseq cannot represent"):
        hf_llama.to_params(hf_llama.model_config(config), hf_llama.read_dir(str(tmp_path / "bias"))[1])


def test_inverse_frequency_buffers_come_back(saved, tmp_path):
    """Older conversions saved RoPE's inv_freq per layer: kept verbatim, never read as a parameter."""
    from safetensors.torch import save_file

    path = saved["theta"][1]
    state = load_file(os.path.join(path, hf.SINGLE))
    for i in range(LAYERS):
        state[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = 1 / 500000.0 ** (torch.arange(0, 16, 2) / 16)
    os.makedirs(tmp_path / "old")
    save_file(state, str(tmp_path / "old" / hf.SINGLE), metadata={"format": "pt"})
    json.dump(json.load(open(os.path.join(path, "config.json"))), open(tmp_path / "old" / "config.json", "w"))
    _, cfg, params, record, buffers = read(str(tmp_path / "old"))
    assert sorted(buffers) == [f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(LAYERS)]
    params = _tree({name: leaf.whole() for name, leaf in leaves(params)})
    hf.write_dir(str(tmp_path / "back"), hf_llama.hf_config(cfg), hf_llama.from_params(cfg, params, record, buffers))
    back = load_file(str(tmp_path / "back" / hf.SINGLE))
    assert sorted(back) == sorted(state)
    for name, t in state.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
