"""Issue 59's cost yardstick taken apart: where the search's seconds go for NVIDIA's Llama 3.1 8B layout.

NVIDIA publishes FP8 only for Llama 3 8B on 8 H100s at s = 8192, t = 1, p = 1, c = 2, d = 4, b = 1, global batch 128
(NeMo 24.12 performance summary): 12,273 tokens/s per GPU, a 10.68 s step. The search prices that layout (the ring,
FP8, full recompute: the only policy that fits 80 GiB in jaxseq's memory) at about twice that. This script prices
NVIDIA's layout with the search's own functions (`search_time.step_time`, `kernel_time`), on the ring layer's
measured costs (`SearchCosts`, the programs the search compiles, cached in results/cost_yardstick_measurements.json),
and splits its compute into the time model's terms, per step; it checks that the terms add up to `step_time`'s
compute. It then prices the attention core on cuDNN's flash kernel (`kernel_time.fused_attention_seconds`) in place of
the ring's explicit blocks: what Megatron's ring runs (Transformer Engine's fused attention on each step's blocks)
and jaxseq's ring does not; a counterfactual, not a row the search ranks.

    python experiments/cost_yardstick.py   # writes results/cost_yardstick.md (compiles 2 ring layers once)
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from jaxseq.config import replace  # noqa: E402
from jaxseq.hardware import HARDWARE  # noqa: E402
from jaxseq.models.formulas import train_flops  # noqa: E402
from jaxseq.planning import kernel_time as kt  # noqa: E402
from jaxseq.planning.costs import costs_of, ring_size, run_kernels  # noqa: E402
from jaxseq.planning.search_costs import SearchCosts  # noqa: E402
from jaxseq.planning.search_memory import memory  # noqa: E402
from jaxseq.planning.search_space import GIB, Candidate, TimeModel  # noqa: E402
from jaxseq.planning.search_time import step_time  # noqa: E402
from jaxseq.presets import preset  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
CACHE = os.path.join(RESULTS, "cost_yardstick_measurements.json")
SEARCH_JSON = os.path.join(RESULTS, "cost_llama3-8b_8xh100_fp8.json")
FUSED_JSON = os.path.join(RESULTS, "cost_llama3-8b_8xh100_fp8_fused.json")  # the same search, --attention fused
SEARCH_COMMAND = ("python -m jaxseq.plan --search --preset llama3-8b --seq-len 8192 --gpus 8 --global-batch 128 "
                  "--hardware h100 --tensor-sizes 1 --context-sizes 2 --micro-batch-sizes 1 "
                  "--remat-policies none,selective,full --tokens 1e12 --price-per-gpu-hour 2 --top 500 --json --fp8")
# NeMo 24.12 performance summary, LLAMA3-8B, FP8, 8 H100s, GBS 128, MBS 1, s 8192, TP 1, PP 1, CP 2, VP 1.
NVIDIA_TOKENS_PER_GPU_S = 12273
NVIDIA_MODEL_TFLOPS = 711
GPUS, GLOBAL_BATCH = 8, 128


def nvidia_layout(remat: str) -> Candidate:
    """NVIDIA's layout as the search enumerates it (the distributed optimizer, as Megatron's recipe runs)."""
    return Candidate(tensor=1, pipe=1, virtual=1, data=4, micro_batch=1, remat=remat, sequence_parallel=False,
                     distributed_optimizer=True, microbatches=GLOBAL_BATCH // 4, context=2, context_strategy="ring",
                     fp8=True)


def compute_terms(cfg, c: Candidate, hw, tm: TimeModel, layer, layer_parameters: float) -> dict[str, float]:
    """`search_time.compute_seconds` for one micro-batch on one rank, split into the time model's terms (its
    kernel-count branch: a layer compiled by XLA:CPU has no `moved_bytes`)."""
    run = run_kernels(cfg, c)
    b, t, ring, remat, layers = c.micro_batch, c.tensor, ring_size(c), c.remat, cfg.layers // c.pipe
    seconds = lambda gemms: sum(kt.gemm_seconds(g, hw, run.itemsize, tm.compute_efficiency, tm.memory_efficiency)
                                for g in gemms)
    hbm = tm.memory_efficiency * hw.hbm_gb_per_s * 1e9
    per_layer = layers / c.context  # a rank runs 1/c of each layer's work (s/c tokens)
    gemms = kt.gemm_kernels(run, b, t, remat, ring)
    forward, backward = kt.ring_block(run, b, t, ring)
    blocks = ring * kt.ring_blocks(ring)
    core = seconds(g for g in gemms if g.name.startswith("ring."))
    elementwise = kt.layer_elementwise_bytes(run, b, t, c.sequence_parallel, remat, ring, c.context)
    ring_bytes, fp8_bytes = kt.ring_bytes(run, b, t, ring, remat), kt.fp8_quantize_bytes(run, b, t, c.context)
    head_gemms = seconds(kt.head_gemms(run, b, t))
    return {
        "layer GEMMs (FP8: QKV, out, MLP up, MLP down; forward, backward, replays)":
            per_layer * seconds(g for g in gemms if not g.name.startswith("ring.")),
        "ring blocks, forward (QKᵀ, P·V)": per_layer * blocks * seconds(forward),
        "ring blocks, backward (QKᵀ again, dP, dQ, dK, dV)": per_layer * blocks * seconds(backward),
        "ring blocks, the policy's forward replay": per_layer * (core - blocks * seconds([*forward, *backward])),
        "ring elementwise (softmax and its gradient over float32 scores)": per_layer * ring_bytes / hbm,
        "FP8 quantization (amax, casts)": per_layer * fp8_bytes / hbm,
        "other elementwise (RMSNorms, residuals, SwiGLU, RoPE)":
            per_layer * (elementwise - ring_bytes - fp8_bytes) / hbm,
        "LM head GEMMs (bf16)": head_gemms / c.context,
        "embedding, final norm, cross-entropy": (kt.head_seconds(run, b, t, c.sequence_parallel, hw,
                                                                 tm.compute_efficiency, tm.memory_efficiency)
                                                 - head_gemms) / c.context,
        "scan stacks: stored activations": layers * kt.STACK_PASSES * layer.stored_bytes / hbm,
        "scan stacks: weights": layers * kt.WEIGHT_STACK_COPIES * 2 * run.itemsize * layer_parameters / hbm,
    }


def flash_core_seconds(cfg, c: Candidate, hw) -> float:
    """One micro-batch's attention core on one rank on cuDNN's flash kernel (the causal half, FlashAttention-3's
    stated efficiencies), the work balanced over the c ranks as Megatron's chunks balance it."""
    flash = replace(run_kernels(cfg, c), attention="fused", fused_kernel="cudnn")
    layer = sum(kt.fused_attention_seconds(flash, c.micro_batch, c.tensor, c.remat, hw))
    return cfg.layers // c.pipe * layer / c.context


def ring_core_figures(cfg, c: Candidate, hw, tm: TimeModel) -> dict[str, float]:
    """Per layer and rank: the ring blocks' FLOPs, HBM bytes (GEMM operands and results, elementwise) and the
    effective TFLOP/s of its GEMMs; the flash kernel's FLOPs for the same causal attention."""
    run = run_kernels(cfg, c)
    b, t, ring = c.micro_batch, c.tensor, ring_size(c)
    core = kt.ring_gemms(run, b, t, ring, c.remat)
    e = run.itemsize
    gemm_bytes = sum(g.batch * (e * (g.m * g.k + g.k * g.n) + (g.result_itemsize or e) * g.m * g.n) for g in core)
    gemm_s = sum(kt.gemm_seconds(g, hw, run.itemsize, tm.compute_efficiency, tm.memory_efficiency) for g in core)
    shapes = kt.forward_gemms(replace(run, attention="fused"), b, t)
    flash_forward = kt.CAUSAL_FRACTION * sum(shapes[name].flops for name in kt.ATTENTION_CORE)
    return {"ring_flops": sum(g.flops for g in core) / ring, "ring_gemm_bytes": gemm_bytes / ring,
            "ring_elementwise_bytes": kt.ring_bytes(run, b, t, ring, c.remat) / ring,
            "ring_gemm_tflops": sum(g.flops for g in core) / gemm_s / 1e12,
            "flash_flops": (1 + kt.FLASH_BACKWARD_FLOPS) * flash_forward / ring}


def measure(cfg) -> SearchCosts:
    """The search's costs for the two ring layers (FP8, full and none), compiled once and cached."""
    cached = json.load(open(CACHE)) if os.path.exists(CACHE) else None
    costs = SearchCosts(cfg, jax.devices(), measured=cached)
    costs.prepare([(1, False, remat, 2, "ring", True) for remat in ("full", "none")], (1,))
    json.dump(costs.measured, open(CACHE, "w"), indent=1, sort_keys=True)
    return costs


def searched_row(c: Candidate, path: str = SEARCH_JSON) -> tuple[int, dict] | None:
    """The search's JSON rank and row for candidate c (None where it does not fit: the search leaves it out)."""
    rows = json.load(open(path))["ranked"]
    return next(((i + 1, r) for i, r in enumerate(rows)
                 if all(r[k] == v for k, v in asdict(c).items() if k in r)), None)


def price(cfg, remat: str, costs: SearchCosts, hw, tm: TimeModel) -> dict:
    """NVIDIA's layout under `remat`: the search's step time and memory, its compute's terms, and the step with the
    attention core on the flash kernel."""
    c = nvidia_layout(remat)
    layer, state = costs_of(cfg, c, costs)
    time = step_time(cfg, c, layer, state, hw, tm)
    terms = {k: c.microbatches * v for k, v in
             compute_terms(cfg, c, hw, tm, layer, state.layer_parameters / (cfg.layers // c.pipe)).items()}
    if abs(sum(terms.values()) - time.compute_s) > 1e-9 * time.compute_s:
        raise AssertionError(f"terms add to {sum(terms.values())} s, step_time's compute is {time.compute_s} s")
    ring_terms = [k for k in terms if k.startswith("ring")]
    flash = c.microbatches * flash_core_seconds(cfg, c, hw)
    return {"candidate": c, "time": time, "terms": terms, "memory_gib": memory(cfg, c, layer, state).total_bytes / GIB,
            "ring_s": sum(terms[k] for k in ring_terms), "flash_s": flash,
            "flash_step_s": time.total_s - sum(terms[k] for k in ring_terms) + flash,
            "figures": ring_core_figures(cfg, c, hw, tm), "row": searched_row(c)}


def render(cfg, priced: dict[str, dict], hw, tm: TimeModel) -> str:
    step_nvidia = GLOBAL_BATCH * cfg.seq_len / (NVIDIA_TOKENS_PER_GPU_S * GPUS)
    model_flops = train_flops(cfg, GLOBAL_BATCH) / GPUS
    full, none = priced["full"], priced["none"]
    out = ["# Issue 59's cost yardstick: the search's compute for NVIDIA's Llama 3.1 8B layout, term by term", "",
           "`python experiments/cost_yardstick.py` (the search's own functions, `search_time.step_time` and "
           "`kernel_time`, on the ring layers `SearchCosts` compiles for the search; no step compiled). "
           f"The search it explains: `{SEARCH_COMMAND}` "
           "([cost_llama3-8b_8xh100_fp8.json](cost_llama3-8b_8xh100_fp8.json)).",
           "",
           f"NVIDIA (NeMo 24.12 performance summary, FP8, t = 1, p = 1, c = 2, d = 4, b = 1, global batch 128, s = "
           f"{cfg.seq_len}): {NVIDIA_TOKENS_PER_GPU_S:,} tokens/s per GPU, {NVIDIA_MODEL_TFLOPS} model TFLOP/s per "
           f"GPU: a {step_nvidia:.2f} s step. Model FLOPs per GPU per step (`formulas.train_flops`): "
           f"{model_flops:.3e}. H100 (search's `--hardware h100`): bf16 peak {hw.peak_tflops:g}, FP8 peak "
           f"{hw.fp8_peak_tflops:g} TFLOP/s, HBM {hw.hbm_gb_per_s:g} GB/s; compute efficiency "
           f"{tm.compute_efficiency}, memory efficiency {tm.memory_efficiency} (`TimeModel`).", "",
           "## The compute, seconds per step (32 micro-batches, one rank of the ring)", "",
           "| term | full (s) | share | none (s) | share |", "|---|---:|---:|---:|---:|"]
    for k in full["terms"]:
        out.append(f"| {k} | {full['terms'][k]:.2f} | {full['terms'][k] / full['time'].compute_s:.0%} "
                   f"| {none['terms'][k]:.2f} | {none['terms'][k] / none['time'].compute_s:.0%} |")
    out.append(f"| **compute (`step_time`)** | **{full['time'].compute_s:.2f}** | "
               f"| **{none['time'].compute_s:.2f}** | |")
    out += ["", "## The step", "", "| | full | none |", "|---|---:|---:|"]
    rows = [("memory, GiB per device (jaxseq's)", lambda p: f"{p['memory_gib']:.1f}"),
            ("the search's row", lambda p: f"{p['row'][0]}" if p["row"] else "none: over 80 GiB"),
            ("step, s (`step_time`)", lambda p: f"{p['time'].total_s:.2f}"),
            ("of which compute, s", lambda p: f"{p['time'].compute_s:.2f}"),
            ("of which K/V ring sends + gradient reduction + optimizer, s",
             lambda p: f"{p['time'].total_s - p['time'].compute_s:.2f}"),
            ("× NVIDIA's step", lambda p: f"{p['time'].total_s / step_nvidia:.2f}"),
            ("ring's attention core (blocks + their elementwise), s", lambda p: f"{p['ring_s']:.2f}"),
            ("the same attention on cuDNN's flash kernel, s", lambda p: f"{p['flash_s']:.2f}"),
            ("step with the flash kernel in place of the ring's blocks, s", lambda p: f"{p['flash_step_s']:.2f}"),
            ("× NVIDIA's step", lambda p: f"{p['flash_step_s'] / step_nvidia:.2f}")]
    out += [f"| {name} | {cell(full)} | {cell(none)} |" for name, cell in rows]
    f = full["figures"]
    out += ["", "## The ring's attention core against the flash kernel (one layer, one rank, one micro-batch, full)",
            "", f"- the ring's blocks ({kt.ring_blocks(2)} of (s/2c)² = {cfg.seq_len // 4}² a rank): "
            f"{f['ring_flops']:.3e} FLOPs (forward, the backward's recompute, full's replay), "
            f"{f['ring_gemm_bytes'] / 1e9:.1f} GB through HBM as GEMM operands and results (float32 scores and dP), "
            f"{f['ring_elementwise_bytes'] / 1e9:.1f} GB in the softmax and its gradient; its GEMMs run at "
            f"{f['ring_gemm_tflops']:.0f} TFLOP/s: memory-bound (head width {cfg.head_dim}).",
            f"- cuDNN's flash kernel for the same causal attention: {f['flash_flops']:.3e} FLOPs (forward and "
            f"backward), the scores on chip, at {kt.FLASH_FORWARD_EFFICIENCY * hw.peak_tflops:.0f} and "
            f"{kt.FLASH_BACKWARD_EFFICIENCY * hw.peak_tflops:.0f} TFLOP/s (FlashAttention-3's H100 figures, stated).",
            "", "The flash rows are a counterfactual: jaxseq's ring (parallel/context.py) runs explicit blocks, "
            "whatever `--attention` says, and the search prices what jaxseq runs.", *fused_search(full["candidate"])]
    return "\n".join(out) + "\n"


def fused_search(c: Candidate) -> list[str]:
    """What the same search ranks with `--attention fused` (cuDNN's flash kernel where a layout runs it: c = 1 and
    no ring), beside NVIDIA's layout's row in it."""
    if not os.path.exists(FUSED_JSON):
        return []
    best = json.load(open(FUSED_JSON))["ranked"][0]
    rank, row = searched_row(c, FUSED_JSON)
    label = lambda r: (f"t = {r['tensor']}, p = {r['pipe']}, v = {r['virtual']}, c = {r['context']}, d = {r['data']}, "
                       f"{r['remat']}, {'FP8' if r['fp8'] else 'bf16'}")
    return ["", "## The same search with `--attention fused` "
            "([cost_llama3-8b_8xh100_fp8_fused.json](cost_llama3-8b_8xh100_fp8_fused.json))", "",
            f"- first: {label(best)}: {best['time_s']['total']:.2f} s a step ({best['time_s']['compute']:.2f} s "
            f"compute), {best['days']['value']:.1f} days, {best['memory_gib']['total']:.1f} GiB.",
            f"- NVIDIA's layout ({label(row)}): rank {rank}, {row['time_s']['total']:.2f} s, "
            f"{row['days']['value']:.1f} days: the ring's layer is explicit attention's whatever `--attention` says."]


def main() -> int:
    cfg = preset("llama3-8b")
    hw, tm = HARDWARE["h100"], TimeModel()
    costs = measure(cfg)
    priced = {remat: price(cfg, remat, costs, hw, tm) for remat in ("full", "none")}
    text = render(cfg, priced, hw, tm)
    open(os.path.join(RESULTS, "cost_yardstick.md"), "w").write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
