"""GPT's Q, K and V as three weights (the default) or as one [h, 3, a, d] kernel (`ModelConfig.fused_qkv`, Megatron's
layout and jaxseq's before it): the same model, loss and gradients, the same Hugging Face tensors, and a run saved
before the field resumes with the layout it was saved in. Why three: models/gpt.py; on the H100's program:
experiments/results/bf16_levers.md and tests/test_gpu_target.py."""

import jax
import numpy as np
import pytest

from jaxseq.config import ConfigError, ModelConfig, replace, validate_model
from jaxseq.interop import hf
from jaxseq.models import model as M
from jaxseq.models.model import saved_model_fields
from jaxseq.sharding import Sharder
from jaxseq.training.checkpoint import check_compatible
from trees import comparable  # the fused layout of split params (or gradients)

CFG = ModelConfig(vocab_size=256, seq_len=32, hidden=64, heads=4, layers=2, dtype="float32", dropout=0.0)
FUSED = replace(CFG, fused_qkv=True)


def test_fused_and_split_qkv_compute_the_same_loss_and_gradients():
    split = M.init_params(jax.random.key(0), CFG)
    split["layers"]["attn"] = {n: {**w, "bias": w["bias"] + 0.01 * (i + 1)}  # nonzero biases, each its own
                               for i, (n, w) in enumerate(split["layers"]["attn"].items())}
    fused = comparable(split)
    assert jax.tree.structure(fused) == jax.tree.structure(M.init_params(jax.random.key(0), FUSED))
    tokens = jax.random.randint(jax.random.key(1), (2, CFG.seq_len + 1), 0, CFG.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    run = lambda cfg, p: jax.jit(jax.value_and_grad(lambda p: M.loss_fn(p, batch, cfg, Sharder(None), "none")))(p)
    (split_loss, split_grads), (fused_loss, fused_grads) = run(CFG, split), run(FUSED, fused)
    assert float(fused_loss) == pytest.approx(float(split_loss), rel=1e-6)
    for a, b in zip(jax.tree.leaves(comparable(split_grads)), jax.tree.leaves(fused_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_both_layouts_write_the_same_hugging_face_tensors():
    split = jax.tree.map(np.asarray, M.init_params(jax.random.key(0), CFG))
    written = [{name: t.load() for name, t in hf.from_params(cfg, params).items()}
               for cfg, params in ((CFG, split), (FUSED, jax.tree.map(np.asarray, comparable(split))))]
    assert written[0].keys() == written[1].keys()
    assert "transformer.h.1.attn.c_attn.weight" in written[0]
    for name in written[0]:
        np.testing.assert_array_equal(written[0][name], written[1][name])


def test_a_gpt_run_saved_before_the_field_resumes_fused():
    saved = {k: v for k, v in CFG.__dict__.items() if k != "fused_qkv"}  # a config.json written before the field
    assert saved_model_fields(saved)["fused_qkv"] is True
    assert saved_model_fields({**saved, "fused_qkv": False})["fused_qkv"] is False
    assert "fused_qkv" not in saved_model_fields({**saved, "family": "llama"})
    check_compatible(saved, FUSED.__dict__)
    with pytest.raises(ConfigError, match=r"cannot resume: .*fused_qkv=True \(saved\) vs False"):
        check_compatible(saved, CFG.__dict__)


@pytest.mark.parametrize("cfg,message", [
    (replace(CFG, fused_qkv="yes"), r"^fused_qkv='yes' must be true or false$"),
    (ModelConfig(family="llama", vocab_size=256, seq_len=32, hidden=64, heads=4, layers=2, fused_qkv=True),
     r"^fused_qkv=True is a GPT-family setting; the Llama families keep Q and K/V apart \(set family: gpt\)$"),
])
def test_a_bad_fused_qkv_is_one_line(cfg, message):
    with pytest.raises(ConfigError, match=message):
        validate_model(cfg)
