"""A layer's GPU time from its shapes, for `plan --search`: each GEMM at an efficiency that depends on its
shape, plus the memory-bound elementwise kernels between them.

GEMMs (NVIDIA, "Matrix Multiplication Background User's Guide", DU-09799-001, 2023, §2.3 and §3,
docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication): cuBLAS
splits the [m, n] output into tiles, one per thread block, and runs them in waves of one tile per SM, so
a GEMM takes ceil(tiles / SMs) tile-times however few tiles the last wave holds (wave quantization), and a
dimension that is not a multiple of the tile pays for a whole tile (tile quantization). Its time is that,
at the achieved fraction of peak of a full wave (the one calibrated constant), or the time to move its
operands and result through HBM if that is longer (the roofline: the attention's QKᵀ and scores×V have
k or n = the head width, and are memory-bound for small heads). The tile is the guide's largest, 256×128,
in whichever orientation quantizes less.

Elementwise kernels (LayerNorm, bias + GELU, scale + mask + softmax, dropout, bias + dropout + residual
add: Megatron-LM's fused kernels) move bytes and do little arithmetic: their time is bytes / (achieved
fraction of HBM bandwidth · bandwidth). The bytes are counted per kernel below (16-bit activations,
1-byte dropout masks), forward, backward and the forward a remat policy replays: Megatron's kernels, what the
papers' runs moved. jaxseq's own layer on a GPU moves what XLA:GPU's fusions move, more than this count; where
the layer is compiled for the GPU the search reads those bytes from its program instead (`search_time.compute_seconds`).

Fused attention (`--attention fused`) on cuDNN's flash kernel (`flash`: a GPU in bf16, where it compiles) is not two
GEMMs through HBM: the scores stay on chip, the causal mask's upper half is skipped, and the backward recomputes the
scores (5 GEMM-sized products to the forward's 2: FlashAttention-2's count). Its time is those FLOPs at the fraction of
peak cuDNN's kernels reach on an H100 (stated below, not fitted), forward and backward apart; a policy that replays
the attention replays the forward. On XLA's kernel (float32, the all-gather context strategy: `config.on_platform`)
it is explicit attention's GEMMs and softmax without its dropout, the scores through HBM, and every policy but
`dots` replays QKᵀ and the softmax (`replayed`).

Under the ring (context parallelism's ring strategy, parallel/context.py) the attention core is the ring's own blocks
whatever `--attention` says: 2c + 1 query-half × key-half blocks of (s/2c)² a rank (the causal mask's empty blocks
skipped, its diagonal ones computed whole), seven GEMMs each in the model's dtype (QKᵀ and P·V; the backward
recomputes every block: QKᵀ, dP, dQ, dK, dV), their scores through HBM in float32 (`ring_gemms`, `ring_bytes`).

Shapes per device for one micro-batch of b sequences (s tokens each, M = s·b), t-way tensor parallelism:
the weight GEMMs take all M tokens (sequence parallelism all-gathers them first), attention's batched
GEMMs run b·a/t heads of [s, d] × [d, s] and [s, s] × [s, d]. Each forward GEMM [m, k] × [k, n] has two
backward GEMMs, [m, n] × [n, k] (the input's gradient) and [k, m] × [m, n] (the weight's, or the other
operand's), and the policy's replayed matmuls run forward again (`remat.RematPolicy.replays`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxseq.config import ModelConfig
from jaxseq.hardware import Hardware
from jaxseq.models import experts, model
from jaxseq.remat import MATMULS, MOE_EXCHANGE_REPLAYED, POLICIES

TILE = (256, 128)  # cuBLAS's largest tile (the guide's examples), either orientation
# An FP8 GEMM's full wave (`ModelConfig.fp8`: the layers' weight GEMMs, e4m3/e5m2 operands, bf16 result) runs at the FP8
# peak (`Hardware.fp8_peak_tflops`) times the compute efficiency times this: the fraction of its peak a GEMM reaches in
# FP8 over the fraction in bf16, on the same GPU and benchmark. The maximum achievable matmul FLOPS (MAMF, the best of
# a scan of large shapes) on H100/H200 SXMs: bf16 794.5 of 989 TFLOP/s (80.3%), FP8 1,453.4 of 1,979 (73.4%) (Stas
# Bekman, "ml-engineering", its accelerator comparison's MAMF tables): 0.914, so a full wave at 0.728 × 0.914 = 0.665
# of 1,979, 1,317 TFLOP/s (1.83× bf16's 720). Stated, not fitted: no FP8 step has been measured here.
FP8_RELATIVE_EFFICIENCY = (1453.4 / 1979) / (794.5 / 989)
# Float32 GEMMs run on TF32 tensor cores (XLA:GPU's default precision for float32 dots, JAX's "Matmul precision"
# docs), at half the 16-bit dense peak on the A100, H100 and H200 (data sheets: 156 of 312, 495 of 989 TFLOP/s).
TF32_FRACTION = 0.5


@dataclass(frozen=True)
class Gemm:
    """batch × ([m, k] × [k, n]), per device."""

    name: str
    m: int
    n: int
    k: int
    batch: int = 1
    result_itemsize: int = 0  # bytes per result element; 0: the operands' (a float32 result: 4)
    fp8: bool = False  # FP8 operands (1 byte), at the FP8 peak; its result in the model's dtype

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k

    def backward(self) -> tuple[Gemm, Gemm]:
        """The two GEMMs of its gradient: [m, n] × [n, k] and [k, m] × [m, n] (FP8 where it is)."""
        return (Gemm(self.name + ".dx", self.m, self.k, self.n, self.batch, fp8=self.fp8),
                Gemm(self.name + ".dw", self.k, self.n, self.m, self.batch, fp8=self.fp8))


def ring_blocks(ring: int) -> int:
    """Query-half × key-half blocks of (s/2c)² each of the c ranks of a ring computes: 2c + 1 (the local causal
    block, then half a block a step: `context.attention_work` with Megatron's chunks)."""
    return 2 * ring + 1


def forward_gemms(cfg: ModelConfig, b: int, t: int) -> dict[str, Gemm]:
    """One layer's forward GEMMs by `remat.MATMULS` name (their FLOPs are `formulas.layer_matmul_flops` / t,
    except that a rank computes max(kv_heads, t)/t K/V heads where t > kv_heads repeats them). Llama's Q and
    K/V are one GEMM here (the same input; two in the model), its gate and up one 2f wide. With `cfg.fp8` the weight
    GEMMs (`WEIGHT_GEMMS`) are FP8 GEMMs; the attention core stays in the model's dtype."""
    s, h, w, f, d = cfg.seq_len, cfg.hidden, cfg.attention_width, cfg.mlp_hidden, cfg.head_dim
    tokens, heads = s * b, b * cfg.heads // t
    qkv = w + 2 * max(cfg.num_kv_heads, t) * d  # 3w for multi-head attention
    up = model.traits(cfg).mlp_up_widths * f
    fp8 = cfg.fp8
    gemms = {"qkv": Gemm("qkv", tokens, qkv // t, h, fp8=fp8), "scores": Gemm("scores", s, s, d, heads),
             "context": Gemm("context", s, d, s, heads), "out": Gemm("out", tokens, h, w // t, fp8=fp8),
             "mlp_up": Gemm("mlp_up", tokens, up // t, h, fp8=fp8),
             "mlp_down": Gemm("mlp_down", tokens, h, f // t, fp8=fp8)}
    return gemms | (moe_gemms(cfg, b, t) if cfg.moe_experts else {})


def moe_slots(cfg: ModelConfig, b: int) -> int:
    """E·C: the slots of a mixture's experts for a routing group of b·s tokens (`experts.capacity`)."""
    return cfg.moe_experts * experts.capacity(b * cfg.seq_len, cfg)


def moe_gemms(cfg: ModelConfig, b: int, t: int) -> dict[str, Gemm]:
    """A mixture's MLP GEMMs (models/experts.py) in place of the dense MLP's: the experts' gate/up and down as one
    batched GEMM each over the E experts' C slots (capacity-padded: every slot computed, filled or not; with
    expert parallelism a rank's e experts hold ep·C slots, the same FLOPs, priced at expert = 1's shape), the router
    [b·s, h] × [h, E] (whole on every tensor rank), and the shared experts' dense MLP (g = shared·f). Under --fp8 only
    the shared experts' are FP8 GEMMs: the experts' batched einsums are not models/fp8.py's."""
    h, f, tokens = cfg.hidden, cfg.mlp_hidden, b * cfg.seq_len
    slots, fp8 = experts.capacity(tokens, cfg), cfg.fp8  # the experts' einsums stay in the model's dtype under --fp8
    gemms = {"mlp_up": Gemm("mlp_up", slots, 2 * f // t, h, cfg.moe_experts),
             "mlp_down": Gemm("mlp_down", slots, h, f // t, cfg.moe_experts),
             "router": Gemm("router", tokens, cfg.moe_experts, h)}
    if cfg.moe_shared_experts:
        g = cfg.moe_shared_experts * f
        gemms |= {"shared_up": Gemm("shared_up", tokens, 2 * g // t, h, fp8=fp8),
                  "shared_down": Gemm("shared_down", tokens, h, g // t, fp8=fp8)}
    return gemms


ATTENTION_CORE = ("scores", "context")  # QKᵀ and scores × V: inside a fused (flash) attention kernel
RING_STEP0_BLOCKS = 3  # the blocks of a ring's first step (its own K/V: the causal diagonals and one whole block)


def ring_gemms(cfg: ModelConfig, b: int, t: int, ring: int, remat: str) -> list[Gemm]:
    """The attention core of one layer as a ring of c ranks computes it (parallel/context.py), all c ranks' work
    (each rank's is 1/c of it): each rank's `ring_blocks` blocks of n × n, n = s/2c, b·a/t heads each, QKᵀ (float32
    result) and P·V forward, and backward every block again whatever the policy: QKᵀ, dP = dO·Vᵀ (float32
    result), dQ = dS·K, dK = dSᵀ·Q, dV = Pᵀ·dO. A policy that replays the whole forward (its QKV matmul: `full`)
    replays the ring's forward too, less the first step's QKᵀ, which XLA merges with the backward's (the same
    queries against the rank's own K: the layer's program has one of each, tests/test_search.py)."""
    (scores, context), backward = ring_block(cfg, b, t, ring)
    blocks = ring * ring_blocks(ring)
    gemms = blocks * [scores, context, *backward]
    if "qkv" in POLICIES[remat].replays:
        gemms += blocks * [context] + (blocks - ring * RING_STEP0_BLOCKS) * [scores]
    return gemms


def ring_block(cfg: ModelConfig, b: int, t: int, ring: int) -> tuple[list[Gemm], list[Gemm]]:
    """One block's GEMMs on one rank of a ring of c: forward (QKᵀ, P·V) and backward (QKᵀ, dP, dQ, dK, dV), each
    priced whole (the ring runs its query rows a tile at a time: the same FLOPs, `context.QUERY_TILE`)."""
    n, d, heads = cfg.seq_len // (2 * ring), cfg.head_dim, b * cfg.heads // t
    scores = Gemm("ring.scores", n, n, d, heads, result_itemsize=4)
    backward = [scores, Gemm("ring.dprobs", n, n, d, heads, result_itemsize=4),
                *(Gemm(f"ring.{name}", n, d, n, heads) for name in ("dq", "dk", "dv"))]
    return [scores, Gemm("ring.context", n, d, n, heads)], backward


# cuDNN's flash attention on an H100 SXM5, bf16, head width 128, 2k tokens: forward 617 and backward 465 TFLOP/s of
# the 989 peak (Shah et al. 2024, "FlashAttention-3", Figs. 5 and 6, FLOPs counted as there: the forward's two
# products, the backward 2.5× them). Stated, not fitted; used for every GPU and head width.
FLASH_FORWARD_EFFICIENCY = 617 / 989
FLASH_BACKWARD_EFFICIENCY = 465 / 989
FLASH_BACKWARD_FLOPS = 2.5  # the backward's work / the forward's: QKᵀ again, dV, dP, dQ, dK against QKᵀ and P·V
CAUSAL_FRACTION = 0.5  # of the s × s tiles a causal kernel computes (the masked half skipped)


def flash(cfg: ModelConfig) -> bool:
    """Whether the layer's attention runs cuDNN's flash kernel (`cfg.fused_kernel`, chosen at an edge:
    `config.on_platform`), the scores never in HBM; else its QKᵀ and scores × V are GEMMs."""
    return cfg.attention == "fused" and cfg.fused_kernel == "cudnn"


def replayed(cfg: ModelConfig, remat: str) -> tuple[str, ...]:
    """The forward GEMMs `remat` replays. In cuDNN's flash kernel the scores never leave the kernel, which recomputes
    them in its own backward whatever the policy: a policy replays the attention core only with the whole forward
    (its QKV matmul: `full`), and `selective` replays nothing (the H100 measured it at `none`'s time and memory).
    XLA's fused kernel (`jax.nn.dot_product_attention`) names none of its tensors, so no policy's list of names keeps
    its probabilities: every policy replays QKᵀ but one that keeps every dot's output (`dots`: the QKᵀ output is
    one); its program compiled for an H100 has that GEMM in `none`'s backward too (tests/test_gpu_target.py)."""
    policy = POLICIES[remat]
    replays = policy.replays
    if flash(cfg) and "qkv" not in replays:
        return tuple(name for name in replays if name not in ATTENTION_CORE)
    if cfg.attention == "fused" and not flash(cfg) and not policy.saves_dots:
        return tuple(name for name in MATMULS if name in replays or name == "scores")
    return replays


def layer_gemms(cfg: ModelConfig, b: int, t: int, remat: str, ring: int = 1) -> list[Gemm]:
    """Every GEMM of one layer's training step: forward, backward, and the forward ones the policy replays; under a
    ring of `ring` > 1 ranks, its blocks (`ring_gemms`) in place of the attention core's."""
    forward = forward_gemms(cfg, b, t)
    if ring > 1:
        forward = {name: g for name, g in forward.items() if name not in ATTENTION_CORE}
    replays = [forward[name] for name in replayed(cfg, remat) if name in forward]
    core = ring_gemms(cfg, b, t, ring, remat) if ring > 1 else []
    return [*forward.values(), *(g for fwd in forward.values() for g in fwd.backward()), *replays, *core]


def fused_attention_seconds(cfg: ModelConfig, b: int, t: int, remat: str, hw: Hardware) -> tuple[float, float, float]:
    """One layer's flash attention kernels on one device: (forward, backward, the forward the policy replays, 0.0
    where it replays none). Without the flash kernel, all 0.0: its QKᵀ and scores × V are GEMMs (`layer_gemms`)."""
    if not flash(cfg):
        return 0.0, 0.0, 0.0
    shapes = forward_gemms(cfg, b, t)
    flops = CAUSAL_FRACTION * sum(shapes[name].flops for name in ATTENTION_CORE)
    forward = flops / (FLASH_FORWARD_EFFICIENCY * hw.peak_tflops * 1e12)
    backward = FLASH_BACKWARD_FLOPS * flops / (FLASH_BACKWARD_EFFICIENCY * hw.peak_tflops * 1e12)
    return forward, backward, forward if ATTENTION_CORE[0] in replayed(cfg, remat) else 0.0


def gemm_kernels(cfg: ModelConfig, b: int, t: int, remat: str, ring: int = 1) -> list[Gemm]:
    """The layer's GEMMs that run as GEMM kernels: `layer_gemms` less the attention core where the flash kernel runs
    it."""
    return [g for g in layer_gemms(cfg, b, t, remat, ring)
            if not (flash(cfg) and g.name.split(".")[0] in ATTENTION_CORE)]


def head_gemms(cfg: ModelConfig, b: int, t: int) -> list[Gemm]:
    """The tied logits (vocabulary split t ways, padded as the model pads it), forward and backward."""
    logits = Gemm("logits", cfg.seq_len * b, cfg.padded_vocab(t) // t, cfg.hidden)
    return [logits, *logits.backward()]


def gemm_seconds(g: Gemm, hw: Hardware, itemsize: int, compute_efficiency: float, memory_efficiency: float) -> float:
    """max(waves of tiles at the achieved fraction of peak (TF32's for float32 operands; an FP8 GEMM's at the FP8 peak,
    `FP8_RELATIVE_EFFICIENCY`), operands and result through HBM)."""
    waves = min(math.ceil(g.batch * math.ceil(g.m / tm) * math.ceil(g.n / tn) / hw.sm_count)
                for tm, tn in (TILE, TILE[::-1]))
    wave_flops = hw.sm_count * 2.0 * TILE[0] * TILE[1] * g.k  # every SM computing one tile
    peak = (hw.fp8_peak_tflops * FP8_RELATIVE_EFFICIENCY if g.fp8
            else hw.peak_tflops * (TF32_FRACTION if itemsize == 4 else 1.0))
    math_s = waves * wave_flops / (compute_efficiency * peak * 1e12)
    operand = 1 if g.fp8 else itemsize
    moved = g.batch * (operand * (g.m * g.k + g.k * g.n) + (g.result_itemsize or itemsize) * g.m * g.n)
    memory_s = moved / (memory_efficiency * hw.hbm_gb_per_s * 1e9)
    return max(math_s, memory_s)


def gemm_efficiency(g: Gemm, hw: Hardware, itemsize: int, compute_efficiency: float = 1.0,
                    memory_efficiency: float = 1.0) -> float:
    """The fraction of peak the GEMM runs at: its FLOPs / (its time · peak)."""
    return g.flops / (gemm_seconds(g, hw, itemsize, compute_efficiency, memory_efficiency) * hw.peak_tflops * 1e12)


# ---------------------------------------------------------------------------------------------
# Elementwise kernels: bytes moved


def layer_elementwise_bytes(cfg: ModelConfig, b: int, t: int, sequence_parallel: bool, remat: str,
                            ring: int = 1, context: int = 1) -> float:
    """HBM bytes of one layer's elementwise kernels, per device (e bytes per activation, one per dropout mask
    element, r = 1 with dropout, else 0). Over the residual stream's s·b·h elements (/t under SP): two
    LayerNorms (forward: read, write, 2e; backward: read x and dy, write dx, 3e) and two bias + dropout +
    residual adds (forward: read both, write the sum and the mask, 3e + r; backward: read dy and the mask,
    write 2e + r). Over the MLP's s·b·f/t: bias + GELU (2e; 3e). Over the b·(a/t)·s² attention scores (none
    with the flash kernel, which keeps them on chip): scale + mask + softmax (2e; 3e) and, with dropout and explicit
    attention (a fused kernel drops none), its dropout (2e + 1; 2e + 1). A policy that replays QKᵀ (`replayed`)
    runs the softmax and its dropout forward again, one
    that replays the QKV matmul (full) the whole forward, one that replays the norms and the MLP's activation
    (`RematPolicy.replays_norms`: lean, dots) their forward (2e over s·b·h twice, and the activation's). Llama
    (no biases; RMSNorm moves LayerNorm's bytes): SwiGLU reads gate and up and writes their product (3e over
    s·b·f/t; backward reads gate, up and dy, writes two gradients, 5e), and RoPE reads and writes q and the rank's
    K heads (2e over s·b·(a + max(kv_heads, t))·d/t; backward the same). Under a ring (`ring_bytes`), its
    blocks' in place of the scores'. At context c (`context`) all c ranks' bytes, as a ring's blocks are (the
    caller divides by c): FP8's quantization of the weights c times over (`fp8_quantize_bytes`)."""
    e, s, r = cfg.itemsize, cfg.seq_len, 1 if cfg.dropout > 0 else 0
    residual = s * b * cfg.hidden / (t if sequence_parallel else 1)
    mlp = (moe_slots(cfg, b) if cfg.moe_experts else s * b) * cfg.mlp_hidden / t  # a mixture's SwiGLU: every slot
    scores = 0 if flash(cfg) or ring > 1 else b * cfg.heads / t * s * s
    r_scores = r if cfg.attention == "explicit" else 0
    traits = model.traits(cfg)
    rope = s * b * (cfg.heads + max(cfg.num_kv_heads, t)) * cfg.head_dim / t * 2 * e if traits.rotary else 0.0
    mlp_forward, mlp_backward = (n * e for n in traits.mlp_elementwise)
    forward_attention = scores * (2 * e + r_scores * (2 * e + 1))
    forward = residual * 2 * (2 * e + 3 * e + r) + mlp * mlp_forward + forward_attention + rope
    backward = (residual * 2 * (3 * e + 2 * e + r) + mlp * mlp_backward + scores * (3 * e + r_scores * (2 * e + 1))
                + rope)
    policy, replays = POLICIES[remat], replayed(cfg, remat)
    if "qkv" in replays:  # the whole forward
        again = forward
    else:
        again = ((forward_attention if "scores" in replays else 0.0)
                 + (residual * 2 * 2 * e + mlp * mlp_forward if policy.replays_norms else 0.0))
    fp8 = fp8_quantize_bytes(cfg, b, t, context) if cfg.fp8 else 0.0
    dispatch = moe_dispatch_bytes(cfg, b, remat) if cfg.moe_experts else 0.0
    return forward + backward + again + fp8 + dispatch + (ring_bytes(cfg, b, t, ring, remat) if ring > 1 else 0.0)


def moe_dispatch_bytes(cfg: ModelConfig, b: int, remat: str) -> float:
    """HBM bytes of a mixture's dispatch and combine, per device: the gather of each slot's token into the [E, C, h]
    buffer (read, write: 2e a slot element) and the weighted scatter-add back (read e, read-modify-write the float32
    [T, h] sum: e + 8 over the slots), forward, the same again backward (their transposes), and a third time where
    the policy keeps not the dispatched buffer (`full`, `dots`, `dots_no_batch` replay the dispatch and combine)."""
    e, slots = cfg.itemsize, moe_slots(cfg, b) * cfg.hidden
    passes = 3 if remat in MOE_EXCHANGE_REPLAYED else 2
    return passes * slots * (2 * e + e + 8)


def fp8_quantize_bytes(cfg: ModelConfig, b: int, t: int, context: int = 1) -> float:
    """HBM bytes of one layer's FP8 quantization (models/fp8.py), per device: each weight GEMM's activation input and
    weight read for their amax and read again and written in e4m3 (2e + 1 a element), in forward and again in
    backward (no remat policy keeps an FP8 copy: the backward quantizes what its policy kept or replayed, the copy
    for the weight gradient transposed as it is cast), and its output gradient read for its amax and cast to e5m2
    twice, as it is and transposed (3e + 2): for gpt3-1.3b at micro-batch 4, 3.3 GB a layer. At context c, the c
    ranks' bytes (`layer_elementwise_bytes`'s unit): each rank's s/c tokens, but each quantizes its whole weights,
    so the weights' c times. With `--target` the search reads these bytes from the FP8 layer's program instead."""
    e = cfg.itemsize
    gemms = [g for name, g in forward_gemms(cfg, b, t).items() if name in WEIGHT_GEMMS and g.fp8]
    operands = sum(g.batch * (g.m * g.k + context * g.k * g.n) for g in gemms)  # [tokens, k] × [k, n] each
    outputs = sum(g.batch * g.m * g.n for g in gemms)
    return 2 * (2 * e + 1) * operands + (3 * e + 2) * outputs


def ring_bytes(cfg: ModelConfig, b: int, t: int, ring: int, remat: str) -> float:
    """HBM bytes of the ring's elementwise kernels over its blocks' elements (`ring_gemms`: all c ranks'), e bytes
    per activation: forward, the log-sum-exp and probabilities from the float32 scores (read 4, write e); backward,
    the probabilities again (4 + e) and dS = P∘(dP − rowsum(dO∘O)) (read P and the float32 dP, write dS: 4 + 2e),
    with dropout the dropped probabilities for dV too (e; the kept factor is drawn from the counter, no mask
    stored); `full` the forward again. Rows' rescaling (n·d per block) left out."""
    e, n = cfg.itemsize, cfg.seq_len // (2 * ring)
    elements = ring * ring_blocks(ring) * b * cfg.heads / t * n * n
    forward = 4 + e
    backward = forward + 4 + 2 * e + (e if cfg.dropout > 0 else 0)
    return elements * (forward + backward + (forward if "qkv" in POLICIES[remat].replays else 0))


def head_elementwise_bytes(cfg: ModelConfig, b: int, t: int, sequence_parallel: bool) -> float:
    """HBM bytes of the embedding, final norm and cross-entropy kernels, per device: the embedding's
    position add and dropout over s·b·h (forward: read, write and the mask, 3e + r; backward: read dy and the
    mask, write, 2e + r), the final norm (2e; 3e, /t under SP), and the vocab-parallel cross-entropy over
    the s·b·V/t logits (read them twice, write their gradient: 3e). Llama has no positions to add: its lookup
    reads a row and writes it (2e)."""
    e, tokens, r = cfg.itemsize, cfg.seq_len * b, 1 if cfg.dropout > 0 else 0
    lookup = 3 * e if model.traits(cfg).learned_positions else 2 * e
    embedding = tokens * cfg.hidden * (lookup + r + 2 * e + r)
    final_norm = tokens * cfg.hidden / (t if sequence_parallel else 1) * (2 * e + 3 * e)
    return embedding + final_norm + tokens * cfg.padded_vocab(t) / t * 3 * e


def layer_matmul_seconds(cfg: ModelConfig, b: int, t: int, remat: str, hw: Hardware, compute_efficiency: float,
                         memory_efficiency: float, ring: int = 1) -> float:
    """One layer's GEMMs and fused attention kernels (forward, backward, the policy's replays) on one device."""
    gemms = sum(gemm_seconds(g, hw, cfg.itemsize, compute_efficiency, memory_efficiency)
                for g in gemm_kernels(cfg, b, t, remat, ring))
    return gemms + sum(fused_attention_seconds(cfg, b, t, remat, hw))


# jaxseq's layers run under `lax.scan`, whose saved activations live in buffers stacked over the layers: each is
# zero-filled before the loop (1 write), each activation copied into its slot (read, write) and sliced out of it again
# in the backward (read, write): 5 passes over the stored bytes. Its weights are stacked too: each layer's are sliced
# out of the stack (read, write) in the forward and again in the backward, and its gradients written into their slot
# (read, write): 3 copies of its parameters in the compute dtype. Megatron's kernel count has none of these; the
# H100's program has them all (`hlo_kernels.kernel_bytes`, experiments/results/gpu_target_vs_measured.md): its
# broadcast, dynamic-update-slice and dynamic-slice fusions.
STACK_PASSES = 5  # over the stored activation bytes
STACK_FILL_PASSES = 1  # of STACK_PASSES: the zero fill, before the layer loops (the other 4 run inside them)
WEIGHT_STACK_COPIES = 3  # of the layer's parameters, each a read and a write


def scan_stack_bytes(stored_bytes: float, layer_parameters: float, itemsize: int) -> float:
    """The bytes one layer's stored activations (`stored_bytes`, per micro-batch) and its weights (`layer_parameters`
    on the device, in `itemsize` bytes) move through the scan's stacked buffers, per micro-batch."""
    return STACK_PASSES * stored_bytes + WEIGHT_STACK_COPIES * 2 * itemsize * layer_parameters


def layer_seconds(cfg: ModelConfig, b: int, t: int, sequence_parallel: bool, remat: str, hw: Hardware,
                  compute_efficiency: float, memory_efficiency: float, ring: int = 1, context: int = 1) -> float:
    """One layer's forward, backward and recompute on one device: its GEMMs and attention + its elementwise kernels
    (at context c all c ranks' time: `layer_elementwise_bytes`)."""
    elementwise = layer_elementwise_bytes(cfg, b, t, sequence_parallel, remat, ring, context)
    return (layer_matmul_seconds(cfg, b, t, remat, hw, compute_efficiency, memory_efficiency, ring)
            + elementwise / (memory_efficiency * hw.hbm_gb_per_s * 1e9))


WEIGHT_GEMMS = ("qkv", "out", "mlp_up", "mlp_down")  # the forward GEMMs with a weight: W computes their .dw


def split_layer_seconds(cfg: ModelConfig, b: int, t: int, sequence_parallel: bool, remat: str, hw: Hardware,
                        compute_efficiency: float, memory_efficiency: float,
                        ring: int = 1, context: int = 1) -> tuple[float, float, float]:
    """`layer_seconds` as zero-bubble pipelining splits it (F, B, W): W the weight GEMMs' gradients (`.dw`), F the
    forward GEMMs (a fused attention's forward kernel in place of its two; a ring's forward blocks in place of them
    too) and a third of the elementwise kernels (they run forward and twice as much backward), B the rest (the input
    gradients, the attention core's backward, the replays)."""
    seconds = lambda g: gemm_seconds(g, hw, cfg.itemsize, compute_efficiency, memory_efficiency)
    forward = forward_gemms(cfg, b, t)
    elementwise = (layer_elementwise_bytes(cfg, b, t, sequence_parallel, remat, ring, context)
                   / (memory_efficiency * hw.hbm_gb_per_s * 1e9))
    kernels = {g.name for g in gemm_kernels(cfg, b, t, remat, ring)}
    ring_forward = ring * ring_blocks(ring) * ring_block(cfg, b, t, ring)[0] if ring > 1 else []
    f = (sum(seconds(g) for g in forward.values() if g.name in kernels) + sum(seconds(g) for g in ring_forward)
         + fused_attention_seconds(cfg, b, t, remat, hw)[0] + elementwise / 3)
    w = sum(seconds(forward[name].backward()[1]) for name in WEIGHT_GEMMS)
    total = layer_seconds(cfg, b, t, sequence_parallel, remat, hw, compute_efficiency, memory_efficiency, ring,
                          context)
    return f, total - f - w, w


def head_seconds(cfg: ModelConfig, b: int, t: int, sequence_parallel: bool, hw: Hardware, compute_efficiency: float,
                 memory_efficiency: float) -> float:
    """The embedding, final norm, logits and loss, forward and backward, on one device."""
    gemms = sum(gemm_seconds(g, hw, cfg.itemsize, compute_efficiency, memory_efficiency) for g in head_gemms(cfg, b, t))
    elementwise = head_elementwise_bytes(cfg, b, t, sequence_parallel)
    return gemms + elementwise / (memory_efficiency * hw.hbm_gb_per_s * 1e9)
