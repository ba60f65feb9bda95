"""What the two mixture-of-experts interop tests share (test_hf_mixtral.py, test_hf_qwen3_moe.py): PyTorch's
gradients of a transformers mixture in jaxseq's parameter tree, and the comparison of the loss and every gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxseq.config import ModelConfig
from jaxseq.models import model
from jaxseq.sharding import Sharder
from jaxseq.training import conversion


def torch_grads_in_jaxseq_layout(grads: dict, cfg: ModelConfig) -> dict:
    """Torch gradients ([out, in] weights; transformers 5 holds the experts fused: gate_up_proj [E, 2f, h],
    down_proj [E, h, f]) in jaxseq's moe tree, vocabulary rows padded with zeros; Qwen3's q/k norms where `cfg`
    has them."""
    h, a, k, d, f, e = cfg.hidden, cfg.heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_hidden, cfg.moe_experts
    pad = lambda g: np.concatenate([g, np.zeros((cfg.padded_vocab(1) - cfg.vocab_size, h), g.dtype)])

    def stack(fn):
        return np.stack([fn(lambda name: grads[f"model.layers.{i}.{name}"]) for i in range(cfg.layers)])

    attn = {"q": {"kernel": stack(lambda g: g("self_attn.q_proj.weight").T.reshape(h, a, d))},
            "kv": {"kernel": stack(lambda g: np.stack([g("self_attn.k_proj.weight").T.reshape(h, k, d),
                                                       g("self_attn.v_proj.weight").T.reshape(h, k, d)], 1))},
            "out": {"kernel": stack(lambda g: g("self_attn.o_proj.weight").T.reshape(a, d, h))}}
    if cfg.qk_norm:
        attn |= {"q_norm": {"scale": stack(lambda g: g("self_attn.q_norm.weight"))},
                 "k_norm": {"scale": stack(lambda g: g("self_attn.k_norm.weight"))}}
    return {
        "embed": {"token": pad(grads["model.embed_tokens.weight"])},
        "layers": {
            "attn_norm": {"scale": stack(lambda g: g("input_layernorm.weight"))},
            "attn": attn,
            "mlp_norm": {"scale": stack(lambda g: g("post_attention_layernorm.weight"))},
            "router": {"kernel": stack(lambda g: g("mlp.gate.weight").T)},
            "experts": {"wi": {"kernel": stack(lambda g: g("mlp.experts.gate_up_proj").reshape(e, 2, f, h)
                                               .transpose(0, 3, 1, 2))},
                        "wo": {"kernel": stack(lambda g: g("mlp.experts.down_proj").transpose(0, 2, 1))}},
        },
        "final_norm": {"scale": grads["model.norm.weight"]},
        "lm_head": {"kernel": pad(grads["lm_head.weight"])},
    }


def assert_loss_and_every_gradient_match(hf, cfg: ModelConfig, params, tokens, load_balancing_loss_func,
                                         coef: float, tolerance: float) -> None:
    """PyTorch's loss: the mean cross-entropy + coef × the sum over layers of each layer's balancing loss
    (transformers' function of that layer's router logits); jaxseq's loss_fn adds the same through its gradient.
    The loss reported (cross-entropy) and every parameter's gradient within `tolerance`, relative."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    hf.zero_grad()
    out = hf(torch.tensor(inputs, dtype=torch.long), output_router_logits=True)
    cross_entropy = torch.nn.functional.cross_entropy(out.logits.reshape(-1, cfg.vocab_size),
                                                      torch.tensor(targets, dtype=torch.long).reshape(-1))
    balance = sum(load_balancing_loss_func((r,), cfg.moe_experts, cfg.moe_top_k) for r in out.router_logits)
    (cross_entropy + coef * balance).backward()
    ref = torch_grads_in_jaxseq_layout({n: p.grad.numpy().copy() for n, p in hf.named_parameters()}, cfg)

    batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}
    loss, grads = jax.value_and_grad(lambda p: model.loss_fn(p, batch, cfg, Sharder(None), "none"))(params)
    assert abs(float(loss) - cross_entropy.item()) <= tolerance * cross_entropy.item()  # the loss reported: CE
    assert jax.tree.structure(ref) == jax.tree.structure(grads)  # every jaxseq parameter is compared
    for (where, want), got in zip(jax.tree_util.tree_flatten_with_path(ref)[0], jax.tree.leaves(grads)):
        name, got = jax.tree_util.keystr(where), np.asarray(got)
        assert got.shape == want.shape and np.linalg.norm(want) > 0, (name, got.shape, want.shape)
        error = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert error <= tolerance, f"{name}: relative error {error:.2e}"


def with_norms_perturbed(hf):
    """`hf` in float32 for evaluation, its norm scales moved off ones (so that a scale read wrongly shows)."""
    hf = hf.float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return hf


def load_padded(path: str):
    """(cfg, params) of the checkpoint at `path` as converted, the vocabulary rows padded (as a run holds them)."""
    cfg, params = conversion.load_hf(path)
    rows = cfg.padded_vocab(1)
    for group, name in (("embed", "token"), ("lm_head", "kernel")):
        leaf = params[group][name]
        params[group][name] = np.concatenate([leaf, np.zeros((rows - len(leaf), cfg.hidden), leaf.dtype)])
    return cfg, params
