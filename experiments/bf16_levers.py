"""Where the bf16 default's H100 step can get faster (issue 57: gpt3-1.3b at 55% MFU, judged on the step priced from
its GPU program). The train step of each model the H100 measured (micro-batch 4 × 2048 tokens, bf16, cuDNN attention,
one GPU), compiled for the H100 on this CPU-only machine for every combination of the levers the program offers:

- the layer loop: `scan` (the default) or `unrolled` (`--layer-loop unrolled`: no stacked buffers);
- the policy: `lean` (a fused GPU run's default) or `none` (equal to `selective` under cuDNN's attention);
- XLA's excess precision: on (XLA's default: it may keep a bf16 value in float32 between ops, and drop the rounding
  the program asks for) or off (`xla_allow_excess_precision=False`: every bf16 the program names is rounded);
- the GEMMs: Triton's program (the one the time model was checked on) or cuBLAS's (Triton's GEMMs off);
- GPT's Q, K and V: three weights (the default) or one (`fused_qkv`: the program the H100 measured), unrolled
  `none` only.

For each: the peak per device (`aot.step_bytes`), the bytes its memory-bound kernels move
(`hlo_kernels.memory_bound_bytes`), the step priced on that program (`search_time.program_step_time`: within 2.1% of
every H100 step measured, experiments/results/gpu_h100_2026-11-27/), its MFU at the H100's 989 TFLOP/s, and the
compile time here (not a GPU's: no autotuning). Then, for the fastest program of each model, where its memory-bound
bytes go: its kernels grouped by the JAX op each came from (HLO metadata), the per-layer ones summed over the layers.
Nothing here ran on a GPU.

    pip install -r requirements-gpu-target.txt
    python experiments/bf16_levers.py     # writes experiments/results/bf16_levers.{json,md} (about 15 minutes)
    python experiments/bf16_levers.py --render-only   # the table again from results/bf16_levers.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "experiments" / "results"
MIB = 2**20
LOOPS, POLICIES = ("scan", "unrolled"), ("lean", "none")
EXCESS = {"on": {}, "off": {"xla_allow_excess_precision": False}}
GEMMS = {"triton": {}, "cublas": {"xla_gpu_enable_triton_gemm": False}}
QKV = {"split": False, "fused": True}  # GPT's Q, K and V: three weights (the default) or one (`fused_qkv`)


def measure(target: str = "h100") -> list[dict]:
    import jax

    from gpu_target import measured_runs  # experiments/gpu_target.py: the configurations the H100 measured
    from jaxseq.config import ParallelConfig, replace
    from jaxseq.hardware import HARDWARE
    from jaxseq.models.formulas import train_flops
    from jaxseq.planning import gpu_target, hlo_kernels
    from jaxseq.planning.costs import LayerCost
    from jaxseq.planning.search_costs import SearchCosts
    from jaxseq.planning.search_space import Candidate, TimeModel
    from jaxseq.planning.search_time import program_step_time
    from jaxseq.training import aot

    hw, tm, rows = HARDWARE[target], TimeModel(), []
    for name, (cfg, micro_batch, _) in measured_runs().items():
        state = SearchCosts(cfg, jax.devices("cpu")[:1]).state(cfg, 1, 1, False, 1)
        for loop, policy, excess, gemms, qkv in itertools.product(LOOPS, POLICIES, EXCESS, GEMMS, QKV):
            if gemms == "cublas" and (loop, policy) != ("unrolled", "none"):
                continue  # the cuBLAS program once, beside the fastest Triton one
            if qkv == "fused" and (cfg.family != "gpt" or (loop, policy, excess) != ("unrolled", "none", "on")):
                continue  # GPT's fused QKV (the program the H100 measured) beside today's default
            start = time.perf_counter()
            run = replace(cfg, layer_loop=loop, fused_qkv=QKV[qkv] and cfg.family == "gpt")
            step = gpu_target.compile_step(run, ParallelConfig(), policy, micro_batch, 1, target,
                                           options={**GEMMS[gemms], **EXCESS[excess]})
            compile_s = time.perf_counter() - start
            moved = hlo_kernels.memory_bound_bytes(step.as_text())
            stored = gpu_target.stored_bytes_per_layer(run, ParallelConfig(), policy, micro_batch, target)
            c = Candidate(1, 1, 1, 1, micro_batch, policy, False, False, 1)
            step_s = program_step_time(cfg, c, LayerCost(stored, {}, 0, 0), state, hw, tm, moved).total_s
            row = {"model": name, "layer_loop": loop, "remat": policy, "excess_precision": excess, "gemms": gemms,
                   "qkv": qkv if cfg.family == "gpt" else "apart",
                   "peak_bytes": aot.step_bytes(step), "memory_bound_bytes": moved, "program_step_s": step_s,
                   "mfu": train_flops(cfg, micro_batch) / (step_s * hw.peak_tflops * 1e12), "compile_s": compile_s}
            row["moved_by_op"] = moved_by_op(step.as_text())
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "moved_by_op"}), flush=True)
    return rows


def moved_by_op(hlo_text: str, top: int = 12) -> list[dict]:
    """The memory-bound kernels' bytes by the JAX op they came from (the op name's last two parts: the transform and
    the primitive, e.g. "transpose(jvp(jvp()))/checkpoint/reduce_sum"), the `top` largest, with how many kernels."""
    from jaxseq.planning import hlo, hlo_kernels

    groups: dict[str, list] = {}
    for k in hlo_kernels.kernels(hlo_text):
        if k.kind in hlo_kernels.MEMORY_BOUND_KINDS:
            name = "/".join(hlo.op_name(k.instr.rest).split("/")[1:]) or k.instr.opcode
            group = groups.setdefault(name, [0, 0])
            group[0], group[1] = group[0] + k.moved_bytes, group[1] + 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"op": name, "bytes": moved, "kernels": count} for name, (moved, count) in ranked]


def table(rows: list[dict], jax_version: str) -> str:
    lines = ["# The bf16 default's levers on the H100's program (`python experiments/bf16_levers.py`)", "",
             f"Each model's train step as the H100 ran it (micro-batch 4 × 2048 tokens, bf16, cuDNN attention, one "
             f"GPU), compiled for the H100 on the CPU-only machine (jax {jax_version} and its CUDA plugin). Peak: MiB "
             "per device. Moved: GB per step of its memory-bound kernels. Step: priced on that program "
             "(`search_time.program_step_time`, within 2.1% of every H100 step measured); MFU at 989 TFLOP/s. "
             "Compile: seconds on this machine (no autotuning). A GPU run's default (`python -m jaxseq.train "
             "--attention fused`): unrolled `none`, excess precision on, the autotuner's GEMMs (scanned `lean` before "
             "unrolled layers became the default). Nothing here ran on a GPU.", "",
             "| model | layers | remat | excess precision | GEMMs | QKV | peak MiB | moved GB | step s | MFU "
             "| compile s |",
             "|---|---|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['layer_loop']} | {r['remat']} | {r['excess_precision']} | {r['gemms']} | "
                     f"{r.get('qkv', 'fused' if r['model'].startswith('gpt') else 'apart')} | "
                     f"{r['peak_bytes'] / MIB:,.0f} | {r['memory_bound_bytes'] / 1e9:.1f} | "
                     f"{r['program_step_s']:.4f} | {100 * r['mfu']:.1f}% | {r['compile_s']:.0f} |")
    for model in dict.fromkeys(r["model"] for r in rows):
        best = min((r for r in rows if r["model"] == model), key=lambda r: r["program_step_s"])
        lines += ["", f"Where {model}'s fastest program ({best['layer_loop']} `{best['remat']}`, excess precision "
                  f"{best['excess_precision']}, {best['gemms']}) moves its {best['memory_bound_bytes'] / 1e9:.1f} GB "
                  "of memory-bound bytes, by the JAX op its kernels came from (the largest):", "",
                  "| JAX op | GB | kernels |", "|---|---:|---:|"]
        lines += [f"| `{g['op']}` | {g['bytes'] / 1e9:.2f} | {g['kernels']} |" for g in best["moved_by_op"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    from jaxseq.planning import gpu_target

    gpu_target.cpu_only()
    import jax

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render-only", action="store_true", help="the table again from results/bf16_levers.json")
    args = parser.parse_args()
    if args.render_only:
        out = json.loads((RESULTS / "bf16_levers.json").read_text())
    else:
        sys.path.insert(0, str(ROOT / "experiments"))
        out = {"jax_version": jax.__version__, "target": "h100", "units": "bytes per device, seconds per step",
               "rows": measure()}
        (RESULTS / "bf16_levers.json").write_text(json.dumps(out, indent=1) + "\n")
    text = table(out["rows"], out["jax_version"])
    (RESULTS / "bf16_levers.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
