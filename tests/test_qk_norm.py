"""Qwen3's per-head RMSNorm on q and k (`qk_norm`, models/llama.py `rotated_qk`) in every layout the attention runs in:
loss and every gradient (float32, the norm scales not ones, head_dim 12 ≠ hidden/heads = 8) equal one device's
under tensor=2 + SP (the K/V heads split), data=2 × tensor=4 + SP (each K/V head repeated over 2 ranks), context=2
(both strategies), a 1F1B pipeline and FSDP, and under every remat policy; the scales are replicated (each tensor rank
normalises its own heads); sampling against the KV cache gives the window-recomputing tokens.
No policy replays a projection for the norm, nor stores more: q and k are kept as the projections give them, so a
layer's FLOPs stay three times its forward matmuls plus the policy's declared replays, and its stored bytes (bf16,
read from the compiled program) the Llama formula's.
With qk_norm off the Llama family is unchanged: no new parameter (its other tests, and the comparisons with
transformers' LlamaForCausalLM, test_llama_reference.py and test_hf_llama.py, pass unchanged). That the norm computes
what Qwen3's does is test_hf_qwen3_moe.py's (against transformers' Qwen3MoeForCausalLM)."""

from functools import lru_cache

import jax
import numpy as np
import pytest

from jaxseq.config import ConfigError, ModelConfig, ParallelConfig, replace, validate
from jaxseq.mesh import make_mesh
from jaxseq.models import formulas as F
from jaxseq.planning import hlo_loops
from jaxseq.models import model as M
from jaxseq.parallel import pipeline as PL
from jaxseq.parallel.layout import Layout
from jaxseq.presets import preset
from jaxseq.remat import POLICIES
from jaxseq.sharding import Sharder
from jaxseq.training import aot
from jaxseq.training import sampling as S
from jaxseq.training import train_step as T

from compiled import B, hlo

CFG = replace(preset("tiny-llama"), dtype="float32", qk_norm=True, kv_channels=12)
LAYOUTS = {
    "tensor=2+sp": ParallelConfig(tensor=2, sequence_parallel=True),
    "data=2,tensor=4+sp": ParallelConfig(data=2, tensor=4, sequence_parallel=True),
    "context=2,tensor=2+sp all-gather": ParallelConfig(data=2, context=2, tensor=2, sequence_parallel=True,
                                                       context_strategy="all-gather"),
    "context=2 ring": ParallelConfig(data=2, context=2, context_strategy="ring"),
    "pipe=2,tensor=2 1f1b": ParallelConfig(pipe=2, tensor=2, schedule="1f1b"),
    "fsdp=4,tensor=2+sp": ParallelConfig(fsdp=4, tensor=2, sequence_parallel=True),
}


def _batch(n=8):
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (n, CFG.seq_len + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _params():
    """tiny-llama's parameters with q/k norm scales that are not ones (padded for tensor=8: masked rows)."""
    params = M.init_params(jax.random.key(1), CFG, tensor=8)
    attn = params["layers"]["attn"]
    for i, name in enumerate(("q_norm", "k_norm")):
        attn[name]["scale"] = attn[name]["scale"] + 0.3 * jax.random.normal(jax.random.key(5 + i), (2, 12))
    return params


def loss_and_grads(parallel: ParallelConfig, remat: str):
    """(loss, grads) of the whole batch; a pipeline's, the mean of its 2 micro-batches' (dropout 0: the same)."""
    layout = Layout(CFG, parallel, make_mesh(parallel, jax.devices()[: parallel.num_devices]))
    if parallel.pipe > 1:
        params = jax.tree.map(jax.device_put, _params(), layout.param_shardings)
        loss, grads = PL.make_loss_and_grad(layout, remat, 2)(params, _batch(), jax.random.key(2))
    elif parallel.fsdp > 1:  # the weights gathered layer by layer: the step's own gradients (test_fsdp's way)
        params = jax.device_put(_params(), layout.master_shardings)
        loss, grads = jax.jit(T.step_gradients(layout, remat, 1))(params, _batch(), jax.random.key(2))
    else:
        loss, grads = T.make_loss_and_grad(layout, remat)(_params(), _batch(), jax.random.key(2))
    return float(loss), jax.device_get(grads)


@pytest.fixture(scope="module")
def reference(devices):
    return loss_and_grads(ParallelConfig(), "none")


def assert_same(result, reference, rtol=1e-5):
    """The loss, and every gradient relative to its largest entry (test_llama's tolerance)."""
    loss, grads = result
    ref_loss, ref_grads = reference
    assert abs(loss - ref_loss) <= rtol * abs(ref_loss), (loss, ref_loss)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        scale = np.max(np.abs(r))
        assert scale > 0, jax.tree_util.keystr(path)  # every parameter gets a gradient, the norm scales too
        err = np.max(np.abs(np.asarray(g) - r)) / scale
        assert err <= rtol, f"{jax.tree_util.keystr(path)}: relative error {err:.2e}"


def test_the_scales_are_one_per_head_dim_replicated_over_tensor():
    layout = Layout(CFG, ParallelConfig(tensor=2), make_mesh(ParallelConfig(tensor=2), jax.devices()[:2]))
    for name in ("q_norm", "k_norm"):
        assert layout.param_shapes["layers"]["attn"][name]["scale"] == (CFG.layers, 12)
        assert all(axis is None for axis in layout.param_shardings["layers"]["attn"][name]["scale"].spec)
    dense = M.param_table(replace(CFG, qk_norm=False))
    assert set(dense["layers"]["attn"]) == {"q", "kv", "out"}  # qk_norm off: Llama's parameters, nothing more


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "tensor=2+sp" else pytest.mark.slow)
                                  for n in LAYOUTS])
def test_layout_matches_single_device(name, reference):
    assert_same(loss_and_grads(LAYOUTS[name], "selective"), reference)


@pytest.mark.slow  # the policy that replays the whole layer and the one that saves every dot's output
@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_policy_matches_none(remat, reference):
    assert_same(loss_and_grads(LAYOUTS["tensor=2+sp"], remat), reference)


# test_flops.py's Llama with the norm: 4 query heads of 64 over one K/V head, no dropout; the q and k projections are
# 5% of a layer's forward + backward, which a replay could not hide in test_flops' 2%.
FLOPS_CFG = ModelConfig(family="llama", vocab_size=512, seq_len=128, hidden=256, heads=4, kv_heads=1, ffn_hidden=384,
                        layers=2, dtype="float32", dropout=0.0, qk_norm=True)


@lru_cache(maxsize=None)
def flops(layers: int, remat: str) -> float:
    parallel = ParallelConfig()
    cfg = replace(FLOPS_CFG, layers=layers)
    cost = aot.compile_loss_and_grad(cfg, parallel, remat, make_mesh(parallel, jax.devices()[:1]), 2).cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


# none, and two policies that keep the projections' outputs (a tag after the norm would make them replay both)
@pytest.mark.parametrize("remat", ["none", pytest.param("selective", marks=pytest.mark.slow),
                                   pytest.param("dots", marks=pytest.mark.slow)])
def test_no_policy_replays_a_projection_for_the_norm(remat):
    """One layer's forward + backward (L=2 minus L=0, as test_flops) against three times its forward matmuls plus
    the policy's replays: the norm and RoPE recomputed (elementwise) but neither projection."""
    matmuls = F.layer_matmul_flops(FLOPS_CFG, 2)
    declared = 3 * sum(matmuls.values()) + sum(matmuls[m] for m in POLICIES[remat].replays)
    q_and_k = 2 * 2 * FLOPS_CFG.seq_len * FLOPS_CFG.hidden * (FLOPS_CFG.heads + 1) * FLOPS_CFG.head_dim
    assert q_and_k > 0.04 * declared
    measured = flops(2, remat) - flops(0, "none")
    assert 0 <= measured / declared - 1 <= 0.02, (remat, measured, declared)


@pytest.mark.slow  # the fast tier holds the FLOPs (test_no_policy_replays_a_projection_for_the_norm[none])
# each way a policy treats the rotated q and k (stored, replayed, saved as a dot's output), with and without SP
@pytest.mark.parametrize("remat, sp", [("none", False), ("selective", True), ("lean", False), ("dots", True),
                                       ("full", True)])
def test_stored_bytes_are_the_llama_formula(remat, sp):
    """tiny-llama in bf16 at t = 4 (its 2 K/V heads repeated), as test_llama_memory holds it without the norm: the
    same bytes, neither the norm's input beside the rotated q and k nor its statistics."""
    cfg = replace(preset("tiny-llama"), dtype="bfloat16", qk_norm=True)
    stored = hlo_loops.stored_bytes_per_layer(hlo(remat, sp, 4, cfg), cfg.layers)
    assert stored == F.activation_bytes(cfg, remat, B, 4, sp)


@pytest.mark.slow  # 20 window recomputes; test_llama holds the cache's fast-tier check
def test_kv_cache_sampling_equals_window_recomputing():
    """The KV cache holds k after the norm and RoPE (`decode_attention`): greedy tokens equal recomputing the window."""
    cfg, params = replace(CFG, seq_len=16), _params()
    logits = jax.jit(lambda p, w: M.logits_fn(p, M.hidden_states(p, w, cfg, Sharder(None), "none"), cfg, Sharder(None)))
    tokens = [5, 200, 17, 133]
    for _ in range(20):
        window = np.zeros((1, cfg.seq_len), np.int32)
        window[0, : len(tokens[-cfg.seq_len:])] = tokens[-cfg.seq_len:]
        tokens.append(int(np.argmax(np.asarray(logits(params, window))[0, len(tokens[-cfg.seq_len:]) - 1,
                                                                        : cfg.vocab_size])))
    assert len(set(tokens[4:])) > 3  # not a degenerate repetition of one token
    assert S.sample(params, cfg, tokens[:4], 20, temperature=1.0, top_k=1) == tokens[4:]


@pytest.mark.parametrize("family, value, message", [
    ("llama", "yes", "qk_norm='yes' must be true or false"),
    ("gpt", True, "qk_norm=True is a Llama-family setting; the gpt family has none"),
])
def test_bad_qk_norm_is_one_line(family, value, message):
    cfg = replace(preset("tiny-llama" if family == "llama" else "tiny"), qk_norm=value)
    with pytest.raises(ConfigError, match=message) as e:
        validate(cfg, ParallelConfig(), "none")
    assert "\n" not in str(e.value)
