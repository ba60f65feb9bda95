"""Whole-model gradients against an outside reference: a small random GPT-2 built with `transformers`,
converted with jaxseq's converter; the loss and the gradient of every jaxseq parameter equal PyTorch
autograd's on the same weights (relative error ≤ 1e-4 per parameter).

Why: the per-op tests check each custom VJP alone; this checks that they compose into the model's
gradient, tied embedding (lookup + logits) and vocabulary padding included. transformers is the only
outside reference: without torch/transformers this fails (an import error), it is never skipped."""

import jax
import numpy as np
import pytest

try:
    import torch
    import transformers
except ImportError as e:  # the outside reference: fail, never skip
    raise ImportError(f"{e}; the comparisons with transformers need `pip install -r requirements-test.txt`") from e

from jaxseq.training import conversion  # noqa: E402
from jaxseq.sharding import Sharder  # noqa: E402
from trees import comparable

VOCAB, SEQ, BATCH, HIDDEN, HEADS, LAYERS = 300, 32, 2, 64, 4, 2  # 300: padded to 384 rows
LN_EPS = 1e-3  # not the default, so a dropped epsilon shows
TOLERANCE = 1e-4


def jaxseq_loss_and_grad(cfg, params, batch):
    """The one place the test calls the jaxseq model: (loss, grads) on one device, no recompute."""
    from jaxseq.models import model as M

    return jax.value_and_grad(lambda p: M.loss_fn(p, batch, cfg, Sharder(None), "none"))(params)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A random float32 GPT-2 (dropout 0) with non-trivial LayerNorm parameters and biases, saved as HF does."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                     layer_norm_epsilon=LN_EPS, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("hf") / "gpt2"
    model.save_pretrained(path, safe_serialization=True)
    return model, str(path)


def torch_loss_and_grads(model, inputs, targets):
    """Mean next-token cross-entropy of logits against targets, and every named parameter's gradient."""
    model.zero_grad()
    logits = model(torch.tensor(inputs, dtype=torch.long)).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.tensor(targets, dtype=torch.long).reshape(-1))
    loss.backward()
    return loss.item(), {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}


def to_jaxseq_layout(grads, padded_vocab):
    """Torch gradients (Conv1D kernels are [in, out]) in jaxseq's tree: stacked over layers, c_attn
    [h, 3h] → [h, 3, a, d], attention c_proj [a·d, h] → [a, d, h], the embedding padded with zero rows."""
    h, a, d = HIDDEN, HEADS, HIDDEN // HEADS

    def stack(name, shape):
        return np.stack([grads[f"transformer.h.{i}.{name}"].reshape(shape) for i in range(LAYERS)])

    wte = grads["transformer.wte.weight"]  # torch ties lm_head to wte: this is lookup + logits together
    return {
        "embed": {"token": np.concatenate([wte, np.zeros((padded_vocab - VOCAB, h), wte.dtype)]),
                  "position": grads["transformer.wpe.weight"]},
        "layers": {
            "ln1": {"scale": stack("ln_1.weight", (h,)), "bias": stack("ln_1.bias", (h,))},
            "attn": {**{name: {"kernel": stack("attn.c_attn.weight", (h, 3, a, d))[:, :, c],
                               "bias": stack("attn.c_attn.bias", (3, a, d))[:, c]} for c, name in enumerate("qkv")},
                     "out": {"kernel": stack("attn.c_proj.weight", (a, d, h)),
                             "bias": stack("attn.c_proj.bias", (h,))}},
            "ln2": {"scale": stack("ln_2.weight", (h,)), "bias": stack("ln_2.bias", (h,))},
            "mlp": {"wi": {"kernel": stack("mlp.c_fc.weight", (h, 4 * h)), "bias": stack("mlp.c_fc.bias", (4 * h,))},
                    "wo": {"kernel": stack("mlp.c_proj.weight", (4 * h, h)), "bias": stack("mlp.c_proj.bias", (h,))}},
        },
        "final_ln": {"scale": grads["transformer.ln_f.weight"], "bias": grads["transformer.ln_f.bias"]},
    }


def test_loss_and_every_gradient_match_pytorch(hf_model):
    model, path = hf_model
    rng = np.random.default_rng(0)
    inputs = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
    targets = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
    ref_loss, ref_grads = torch_loss_and_grads(model, inputs, targets)
    assert set(ref_grads) >= {"transformer.wte.weight", "transformer.h.1.mlp.c_proj.bias"}

    cfg, params = conversion.load_hf(path)
    assert (cfg.dropout, cfg.dtype, cfg.ln_eps, cfg.vocab_size) == (0.0, "float32", LN_EPS, VOCAB)
    rows = cfg.padded_vocab(1)
    assert rows == 384
    token = params["embed"]["token"]
    params["embed"]["token"] = np.concatenate([token, np.zeros((rows - len(token), HIDDEN), token.dtype)])
    loss, grads = jaxseq_loss_and_grad(cfg, params, {"inputs": inputs, "targets": targets})

    assert abs(float(loss) - ref_loss) <= TOLERANCE * abs(ref_loss), (float(loss), ref_loss)
    expected = to_jaxseq_layout(ref_grads, rows)
    assert jax.tree.structure(expected) == jax.tree.structure(grads)  # every jaxseq parameter is compared
    paths = jax.tree_util.tree_flatten_with_path(comparable(expected))[0]  # Q, K, V as c_attn: trees.comparable
    for (where, ref), got in zip(paths, jax.tree.leaves(comparable(jax.device_get(grads)))):
        name = jax.tree_util.keystr(where)
        got = np.asarray(got)
        assert got.shape == ref.shape, (name, got.shape, ref.shape)
        assert np.linalg.norm(ref) > 0, name  # a zero reference would make the comparison vacuous
        error = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert error <= TOLERANCE, f"{name}: relative error {error:.2e}"
    assert not np.asarray(grads["embed"]["token"])[VOCAB:].any()  # padded rows get no gradient
