"""The experts' GEMMs in XLA:GPU's program for an H100, compiled here without one (the CUDA plugin's deviceless
compile, planning/gpu_target.py), both GEMM backends XLA may pick (its Triton fusion, cuBLAS forced):

1. jaxseq's capacity-padded expert GEMM (models/experts.expert_mlps: `enh,ehcf->encf`, e local experts × N slots)
   at Qwen3-30B-A3B's width on 16 expert ranks: one batched GEMM (a dot with the experts as its batch dimension, or
   one cuBLASLt call), its FLOPs the useful ones, no temporary beyond cuBLAS's workspace;
2. `jax.lax.ragged_dot` (the grouped GEMM a dropless MoE would call) at 8,192 tokens × 64 groups: what it becomes;
3. what dropless costs here: every expert's slots padded to a group's T tokens, E/(k·factor) times the buffers.

    pip install -r requirements-gpu-target.txt
    python experiments/moe_gemms.py     # writes experiments/results/moe_gemms.md (about 1 min on the 2-core machine)
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "experiments" / "results"
MIB = 2**20


def compile_for_h100(fn, shapes, gemms: str):
    """(compiled, optimized HLO text) of fn on abstract inputs for one H100 target device."""
    import jax
    from jax.sharding import SingleDeviceSharding

    from jaxseq.planning import gpu_target

    device = SingleDeviceSharding(gpu_target.target_devices("h100", 1)[0])
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=device) for shape, dtype in shapes]
    compiled = jax.jit(fn).lower(*args).compile(gpu_target.GEMMS[gemms])
    return compiled, compiled.as_text()


def largest_arrays(text: str, count: int = 3) -> list[tuple[str, tuple[int, ...], int]]:
    """The `count` largest arrays any instruction of a program produces: (dtype, dims, bytes), ties by dtype and dims
    (the same table each run)."""
    from jaxseq.planning import hlo

    found = {(dt, dims) for instrs in hlo.parse_hlo(text).values() for ins in instrs for dt, dims in ins.arrays()}
    return sorted(((dt, dims, hlo.array_bytes(dt, dims)) for dt, dims in found),
                  key=lambda a: (-a[2], a[0], a[1]))[:count]


def gemm_lines(text: str, op: str) -> list[str]:
    """The program's dots, GEMM fusions and cuBLAS calls that came from the jaxpr op `op`."""
    return [line.strip().split(", metadata")[0] for line in text.splitlines()
            if f'op_name="jit(<lambda>)/{op}' in line and any(k in line for k in (" dot(", "__cublas", "kind=kCustom"))]


def main() -> None:
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_platforms", "cpu")
    from jaxseq.presets import preset
    from jaxseq.models import experts

    bf16, lines = jnp.bfloat16, ["# The experts' GEMMs in the program compiled for an H100 (JAX "
                                 f"{jax.__version__}, `python experiments/moe_gemms.py`)", ""]
    qwen = preset("qwen3-30b-a3b")
    local, tokens, h, f = qwen.moe_experts // 16, 4096, qwen.hidden, qwen.mlp_hidden
    slots = experts.capacity(tokens, qwen)  # a group of one 4096-token sequence, factor 1.25
    n = 16 * slots  # every expert rank's slots of a local expert
    useful = 2 * local * n * h * 2 * f
    lines += [f"## 1. jaxseq's expert GEMM: `enh,ehcf->encf`, e = {local} local experts (128 over 16 ranks), "
              f"N = 16 × C = 16 × {slots} slots (T = {tokens}, k = 8, factor 1.25), h = {h}, 2f = {2 * f}, bf16", "",
              "| GEMMs | the program's GEMM | temporaries (bytes) | FLOPs (useful) |", "| --- | --- | --- | --- |"]
    for gemms in ("triton", "cublas"):
        compiled, text = compile_for_h100(lambda x, w: jnp.einsum("enh,ehcf->encf", x, w),
                                          [((local, n, h), bf16), ((local, h, 2, f), bf16)], gemms)
        found = gemm_lines(text, "enh,ehcf->encf")
        lines.append(f"| {gemms} | `{found[0][:150]}` | {compiled.memory_analysis().temp_size_in_bytes:,} | "
                     f"{useful:,} |")
    lines += ["", "One batched GEMM either way (a dot whose batch dimension is the experts; cuBLAS: one "
              "`__cublas$lt$matmul` call over them), 2·e·N·h·2f FLOPs, no temporary but cuBLAS's 4 MiB workspace.",
              ""]

    m, groups, k, width = 8192, 64, 2048, 768
    lines += [f"## 2. `jax.lax.ragged_dot`: [{m}, {k}] tokens × [{groups}, {k}, {width}] groups, bf16", "",
              "| GEMMs | temporaries (MiB) | the three largest arrays | the GEMM |", "| --- | --- | --- | --- |"]
    for gemms in ("triton", "cublas"):
        compiled, text = compile_for_h100(lambda x, w, sizes: jax.lax.ragged_dot(x, w, sizes),
                                          [((m, k), bf16), ((groups, k, width), bf16), ((groups,), jnp.int32)], gemms)
        big = ", ".join(f"{dt}{list(dims)}" for dt, dims, _ in largest_arrays(text))
        found = gemm_lines(text, "ragged_dot_general")
        lines.append(f"| {gemms} | {compiled.memory_analysis().temp_size_in_bytes / MIB:,.1f} | {big} | "
                     f"`{found[-1][:110]}` |")
    lines += ["", f"Expanded densely, as the issue's probe found: every token masked into every group "
              f"([{m}, {groups}, {k}], {m * groups * k * 2 / MIB:,.0f} MiB bf16, and an s32 index of the same shape), "
              f"then one dense GEMM of [{m}, {groups * k}] × [{groups * k}, {width}]: {groups}× the useful FLOPs. "
              "jaxseq does not use it.", ""]

    lines += ["## 3. What dropless costs", "",
              "Dropless here is capacity T: each expert's slots padded to the group's tokens, so the dispatch and "
              "combine buffers, the experts' hidden activations and the all-to-all bytes all grow by T / C = "
              "E / (k · factor) against a capacity factor's:", "",
              "| model | E | k | T | C at 1.25 | dropless C | × |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in ("tiny-moe", "mixtral-8x7b", "qwen3-30b-a3b"):
        cfg = preset(name)
        t = cfg.seq_len
        c = math.ceil(1.25 * t * cfg.moe_top_k / cfg.moe_experts)
        lines.append(f"| {name} | {cfg.moe_experts} | {cfg.moe_top_k} | {t} | {c} | {t} | {t / c:.1f} |")
    lines += ["", "A grouped GEMM over ragged groups and a ragged all-to-all (Megatron-LM's and MegaBlocks' dropless) "
              "would cost the useful bytes; at this JAX XLA:GPU has neither as one kernel (2.).", ""]
    out = RESULTS / "moe_gemms.md"
    out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
