"""The plan against the GPU: every configuration the H100 measured (experiments/results/gpu_h100_2026-11-26/), its
peak memory as measured, as `plan --target h100` predicts it (XLA:GPU's program, compiled here without a GPU) and as
the CPU plan predicts it (XLA:CPU on simulated devices, what `plan` gives without --target), with each error.

    pip install -r requirements-gpu-target.txt
    python experiments/gpu_target.py      # writes experiments/results/gpu_target_vs_measured.{json,md} (about 3 minutes)

Peaks measured: `memory_stats()["peak_bytes_in_use"]` of each configuration alone in its process (experiments/gpu.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "experiments" / "results"
MEASURED = RESULTS / "gpu_h100_2026-11-26"
POLICIES = ("none", "selective", "lean", "full")
MIB = 2**20


def measured_runs() -> dict:
    """model name → (ModelConfig as the GPU ran it, micro-batch, {policy: peak bytes})."""
    from jaxseq.config import ModelConfig

    runs = {}
    for path in sorted(MEASURED.glob("h100_*_mb*.json")):
        for name, model in json.loads(path.read_text())["models"].items():
            peaks = {p: model["policies"][p]["peak_bytes_in_use"] for p in POLICIES}
            runs[name] = (ModelConfig(**model["config"]), model["micro_batch"], peaks)
    return runs


def compare(target: str = "h100") -> list[dict]:
    import jax

    from jaxseq.config import ParallelConfig, replace
    from jaxseq.planning import gpu_target
    from jaxseq.planning.plan import plan
    from jaxseq.training import aot

    rows = []
    for name, (cfg, micro_batch, peaks) in measured_runs().items():
        start = time.perf_counter()
        cpu_plan = plan(replace(cfg, fused_kernel="xla", matmul="einsum"), 1, micro_batch, jax.devices("cpu")[:1], name,
                        policies=POLICIES)  # what `plan` gives: the portable model on XLA:CPU
        cpu_s = time.perf_counter() - start
        for policy in POLICIES:
            start = time.perf_counter()
            step = gpu_target.compile_step(cfg, ParallelConfig(), policy, micro_batch, 1, target)
            rows.append({"model": name, "remat": policy, "micro_batch": micro_batch, "measured_bytes": peaks[policy],
                         "target_bytes": aot.step_bytes(step), "cpu_plan_bytes": cpu_plan.row(policy).total_bytes_per_device,
                         "target_compile_s": time.perf_counter() - start, "cpu_plan_s": cpu_s})
    for r in rows:
        r["target_error"] = r["target_bytes"] / r["measured_bytes"] - 1
        r["cpu_plan_error"] = r["cpu_plan_bytes"] / r["measured_bytes"] - 1
    return rows


def table(rows: list[dict], target: str, jax_version: str) -> str:
    lines = [f"# The plan against the H100's measured peaks (`python experiments/gpu_target.py`)", "",
             f"Measured: one H100 80GB HBM3, JAX 0.11.2, bf16, cuDNN attention, micro-batch 4 × 2048 tokens "
             f"({MEASURED.relative_to(ROOT)}). `--target {target}`: the whole donated train step compiled for the "
             f"{target.upper()} on this CPU-only machine with jax {jax_version} and its CUDA plugin (argument + output + temp − "
             f"alias). CPU plan: `plan` without "
             f"--target (XLA:CPU, simulated devices). MiB per device.", "",
             "| model | remat | measured | --target h100 | error | CPU plan | error |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['remat']} | {r['measured_bytes'] / MIB:,.0f} | {r['target_bytes'] / MIB:,.0f} | "
                     f"{100 * r['target_error']:+.1f}% | {r['cpu_plan_bytes'] / MIB:,.0f} | {100 * r['cpu_plan_error']:+.1f}% |")
    worst = max(abs(r["target_error"]) for r in rows)
    lines += ["", f"Largest |error| of --target {target}: {100 * worst:.1f}%; of the CPU plan: "
              f"{100 * max(abs(r['cpu_plan_error']) for r in rows):.1f}%."]
    return "\n".join(lines) + "\n"


def main() -> int:
    from jaxseq.planning import gpu_target

    gpu_target.cpu_only()
    import jax

    rows = compare()
    out = {"jax_version": jax.__version__, "target": "h100", "units": "bytes per device", "rows": rows}
    (RESULTS / "gpu_target_vs_measured.json").write_text(json.dumps(out, indent=1) + "\n")
    text = table(rows, "h100", jax.__version__)
    (RESULTS / "gpu_target_vs_measured.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
