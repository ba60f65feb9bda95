"""FLOP accounting: model FLOPs are the paper's formula, and each remat policy's declared replays
(the forward matmuls its backward runs again) are what XLA's cost analysis counts; and the bytes a program's kernels
move (`hlo_kernels.kernel_bytes`) are what it counts."""

from functools import lru_cache

import jax
import jax.numpy as jnp
import pytest

from jaxseq.config import ModelConfig, ParallelConfig, replace
from jaxseq.presets import preset
from jaxseq.mesh import make_mesh
from jaxseq.models import formulas as F
from jaxseq.planning import hlo_kernels
from jaxseq.remat import MATMULS, POLICIES
from jaxseq.training import aot
from jaxseq.training.metrics import throughput

# Wide heads (d = 128) and no dropout, so that matmuls dominate the elementwise work XLA also counts.
CFG = ModelConfig(vocab_size=512, seq_len=128, hidden=256, heads=2, layers=2, dtype="float32", dropout=0.0)
B = 2


@lru_cache(maxsize=None)
def layer_flops(remat: str) -> float:
    """XLA's count for one layer's forward + backward (cost analysis counts a scan body once), plus
    the embedding and logits, which are the same for every policy."""
    parallel = ParallelConfig(data=1, tensor=1)
    compiled = aot.compile_loss_and_grad(CFG, parallel, remat, make_mesh(parallel, jax.devices()[:1]), B)
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


@pytest.mark.parametrize("name", ["gpt2-124m", "gpt3-175b", "megatron-1t"])
def test_model_flops_are_the_papers_formula(name):
    cfg = preset(name)
    paper = F.model_flops(8, cfg.seq_len, cfg.layers, cfg.hidden, cfg.vocab_size)
    assert F.train_flops(cfg, 8) == pytest.approx(paper, rel=1e-12)


def test_attention_wider_than_hidden_counts_its_own_width():
    cfg = preset("gpt3-1.3b")  # 24 heads of 128 = 3072 on a 2048-wide model
    narrow = replace(cfg, kv_channels=None, heads=16)
    assert F.train_flops(cfg, 1) > F.train_flops(narrow, 1)


def test_replays_name_the_layers_matmuls():
    assert tuple(F.layer_matmul_flops(CFG, B)) == MATMULS
    assert all(set(p.replays) <= set(MATMULS) for p in POLICIES.values())


@pytest.mark.slow
@pytest.mark.parametrize("remat", sorted(POLICIES))
def test_declared_replays_are_what_xla_recomputes(remat):
    matmuls = F.layer_matmul_flops(CFG, B)
    declared = sum(matmuls[m] for m in POLICIES[remat].replays)
    measured = layer_flops(remat) - layer_flops("none")
    # Softmax, LayerNorm and GELU recompute add or save a little; a wrongly declared matmul (the
    # smallest is QKᵀ, 1.3% of the layer's model FLOPs here) cannot hide in 0.5%.
    assert abs(measured - declared) <= 0.005 * 3 * sum(matmuls.values()), (remat, measured, declared)


def test_throughput_reports_the_replays_and_mfu():
    out = throughput(CFG, "full", B, steps=10, seconds=2.0, num_devices=4, peak=100.0)
    model, hardware = F.train_flops(CFG, B), F.train_flops(CFG, B, "full")
    assert out["tokens_per_sec"] == B * CFG.seq_len * 10 / 2.0
    assert out["tflops_per_device"] == pytest.approx(model * 5 / 4 / 1e12)
    assert out["hardware_tflops_per_device"] == pytest.approx(hardware * 5 / 4 / 1e12)
    assert out["mfu"] == pytest.approx(out["tflops_per_device"] / 100.0)
    assert throughput(CFG, "none", B, 10, 2.0, 4, None)["mfu"] is None


def test_llama_model_flops_are_xlas_count():
    """Grouped-query attention (K and V one head wide here) and SwiGLU's two up kernels: one Llama layer's
    forward + backward, the embedding lookup and the logits, as XLA's cost analysis counts them (within the
    elementwise work it adds: RMSNorm, RoPE, SwiGLU, softmax; counting K/V as wide as Q and one up kernel
    would be 10% off; XLA counts 1.2% more than the formula)."""
    cfg = replace(CFG, family="llama", kv_heads=1, ffn_hidden=512, layers=1)
    parallel = ParallelConfig(data=1, tensor=1)
    compiled = aot.compile_loss_and_grad(cfg, parallel, "none", make_mesh(parallel, jax.devices()[:1]), B)
    cost = compiled.cost_analysis()
    measured = float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])
    assert abs(measured - F.train_flops(cfg, B)) <= 0.02 * F.train_flops(cfg, B), (measured, F.train_flops(cfg, B))


# Llama: GQA (4 query heads of 64 share one K/V head) and SwiGLU's three f-wide matmuls, no dropout.
LLAMA = ModelConfig(family="llama", vocab_size=512, seq_len=128, hidden=256, heads=4, kv_heads=1, ffn_hidden=384,
                    layers=2, dtype="float32", dropout=0.0)


@lru_cache(maxsize=None)
def llama_flops(layers: int, remat: str) -> float:
    parallel = ParallelConfig(data=1, tensor=1)
    cfg = replace(LLAMA, layers=layers)
    cost = aot.compile_loss_and_grad(cfg, parallel, remat, make_mesh(parallel, jax.devices()[:1]), B).cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


@pytest.mark.parametrize("remat", [pytest.param(r, marks=() if r == "none" else pytest.mark.slow)
                                   for r in sorted(POLICIES)])
def test_llama_layer_flops_are_the_formula(remat):
    """One layer's forward + backward (cost analysis counts the scan body once: L=2 minus L=0) against three
    times its forward matmuls plus the policy's replays. RMSNorm, RoPE, SiLU and softmax add 1.3% here; K and
    V (6% of the layer) or SwiGLU's up matmul (19%) counted wrong could not hide in 2%."""
    matmuls = F.layer_matmul_flops(LLAMA, B)
    declared = 3 * sum(matmuls.values()) + sum(matmuls[m] for m in POLICIES[remat].replays)
    kv = 2 * B * LLAMA.seq_len * LLAMA.hidden * 2 * LLAMA.num_kv_heads * LLAMA.head_dim
    assert 3 * kv > 0.04 * declared
    measured = llama_flops(2, remat) - llama_flops(0, "none")
    assert 0 <= measured / declared - 1 <= 0.02, (remat, measured, declared)


def test_llama_model_flops_count_kv_heads_once_and_three_mlp_matmuls():
    cfg = preset("llama3-8b")
    b, s, h, f, L, V = 1, cfg.seq_len, cfg.hidden, cfg.mlp_hidden, cfg.layers, cfg.vocab_size
    per_layer = 2 * s * h * (h + 2 * 8 * 128) + 4 * s * s * h + 2 * s * h * h + 3 * 2 * s * h * f
    assert F.train_flops(cfg, b) == 3 * (L * per_layer + 2 * s * h * V)


def test_kernel_bytes_are_xlas_bytes_accessed():
    """`hlo_kernels.kernel_bytes` against XLA's own accounting (`cost_analysis()["bytes accessed"]`) of a loop-free
    program that writes a row into a donated stacked buffer and reads another back, with a matmul, converts, a softmax
    and reductions: within 64 bytes of its 8.9 MB, where the stack alone is 2 MB (jax 0.10's XLA:CPU converts the whole
    stack around its update, and reads only the row it slices; jax 0.12's, 2.6 MB in all, updates the row in place:
    between them both of kernel_bytes' slice rules are held to XLA's)."""
    def step(stack, x, w, i):
        h = jnp.tanh(x @ w).astype(jnp.bfloat16)
        stack = jax.lax.dynamic_update_slice(stack, h[None], (i, 0, 0))
        back = jax.lax.dynamic_slice(stack, (i + 1, 0, 0), (1, 256, 256))[0].astype(jnp.float32)
        return stack, jax.nn.softmax(back, axis=-1).sum(0) + x.T.sum(1)

    args = (jnp.zeros((16, 256, 256), jnp.bfloat16), jnp.ones((256, 256)), jnp.ones((256, 256)), 3)
    compiled = jax.jit(step, donate_argnums=0).lower(*args).compile()
    text = compiled.as_text()
    assert "while" not in text  # XLA counts a loop's body once; kernel_bytes × its trip count (test_hlo.py)
    cost = compiled.cost_analysis()
    accessed = float((cost[0] if isinstance(cost, (list, tuple)) else cost)["bytes accessed"])
    moved = sum(b for kinds in hlo_kernels.kernel_bytes(text).values() for b in kinds.values())
    assert abs(moved - accessed) <= 64, (moved, accessed)
