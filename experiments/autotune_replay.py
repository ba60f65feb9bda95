"""The H100's own GEMM choices, compiled offline: does `plan --target` then give the measured peak?

    python experiments/autotune_replay.py   # writes experiments/results/autotune_replay_jax<version>.{md,json}

Each configuration that experiments/gpu.py ran on an H100 on 2026-11-27 (results/gpu_2026-11-27_autotune/h100/)
recorded what the device's autotuner chose for its train step (xla_gpu_dump_autotune_results_to). Here each step
compiles for the H100 target on this CPU-only machine three ways:
- with those choices loaded (`planning/autotune.py`: `plan --target h100 --autotune-results FILE`), each in a
  process of its own;
- with every GEMM a Triton fusion (XLA's default without a device);
- with every GEMM handed to cuBLAS.
`plan --target` without a file takes the larger of the last two. Each is set beside the device's
`peak_bytes_in_use`. The replay is the device's program only on the JAX that recorded it (0.11.2, with its CUDA
plugin: requirements-gpu-device.txt); on 0.12 it names the GEMMs it finds no choice for, and JAX 0.10's XLA cannot
read the file. It takes about 15 minutes on the 2-core machine.

It also counts the fusions that two runs' files both hold but chose differently: the autotuner times its candidates,
so a close call can go either way.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RUN = ROOT / "experiments" / "results" / "gpu_2026-11-27_autotune" / "h100"
RESULTS = ROOT / "experiments" / "results"
MIB = 2**20


def recorded_runs() -> list[dict]:
    """Each configuration of the H100's run with its recorded choices: label, config, policy, micro-batch, peak,
    file."""
    from jaxseq.config import ModelConfig, replace
    from jaxseq.models.model import saved_model_fields

    (model,) = json.loads((RUN / "gpu.json").read_text())["models"].values()
    cfg = ModelConfig(**saved_model_fields(model["config"]))
    runs = [(f"{p}, b={model['micro_batch']}", cfg, p, model["micro_batch"], r) for p, r in model["policies"].items()]
    runs += [(f"{p}, unrolled, b={model['micro_batch']}", replace(cfg, layer_loop="unrolled"), p,
              model["micro_batch"], r)
             for p, r in model["unrolled"].items()]
    runs += [(f"{p}, b={r['micro_batch']} (its largest)", cfg, p, r["micro_batch"], r)
             for p, r in model["largest_micro_batch"].items()]
    return [{"label": label, "config": c, "remat": p, "micro_batch": b, "measured_bytes": r["peak_bytes_in_use"],
             "file": RUN / "autotune" / Path(r["autotune_results"]).name} for label, c, p, b, r in runs]


def replay(target: str = "h100") -> list[dict]:
    from jaxseq.config import ParallelConfig
    from jaxseq.planning import autotune, gpu_target
    from jaxseq.training import aot

    out = []
    for r in recorded_runs():
        cfg, policy, b = r["config"], r["remat"], r["micro_batch"]
        print(f"{r['label']} …", flush=True)
        recorded = autotune.RecordedGemms(str(r["file"]))
        peaks = {g: aot.step_bytes(gpu_target.compile_step(cfg, ParallelConfig(), policy, b, 1, target, g))
                 for g in gpu_target.GEMMS}
        replayed = autotune.replay(cfg, ParallelConfig(), policy, b, 1, target, recorded)
        out.append({**{k: v for k, v in r.items() if k not in ("config", "file")}, "layer_loop": cfg.layer_loop,
                    "file": str(r["file"].relative_to(ROOT)), "recorded_cublas_choices": recorded.cublas_choices,
                    "replay_bytes": replayed["bytes"], "fusions_without_a_choice": replayed["missing"],
                    "gemms_without_a_choice": len(replayed["gemms"]),
                    "triton_bytes": peaks["triton"], "cublas_bytes": peaks["cublas"],
                    "target_bytes": max(peaks.values())})
    return out


def disagreements() -> dict:
    """Fusions (by fingerprint) that more than one file holds, and how many of them the files chose differently."""
    choices = defaultdict(set)
    for path in sorted((RUN / "autotune").glob("*.textproto")):
        for entry in path.read_text().split("entries {")[1:]:
            fingerprint = re.search(r'hlo_fingerprint: "(\w+)"', entry).group(1)
            choices[fingerprint].add(re.search(r"backend: (\w+)", entry).group(1))
    split = {f: sorted(c) for f, c in choices.items() if len(c) > 1}
    gemm = sum(1 for c in split.values() if any(b.startswith(("CUBLAS", "TRITON")) for b in c))
    return {"fusions": len(choices), "chosen_differently": len(split), "gemms_chosen_differently": gemm}


def table(rows: list[dict], split: dict, jax_version: str) -> str:
    error = lambda r, key: f"{100 * (r[key] / r['measured_bytes'] - 1):+.2f}%"
    lines = [f"# The H100's GEMM choices replayed offline (JAX {jax_version})", "",
             f"`python experiments/autotune_replay.py` on the CPU-only machine: each configuration of "
             f"`{RUN.relative_to(ROOT)}` (experiments/gpu.py on one H100, JAX 0.11.2, 2026-11-27) compiled for the "
             "H100 target with the autotuner's choices that run recorded (`plan --target h100 --autotune-results "
             "FILE`), and as `plan --target` does without them (the larger of the all-Triton and all-cuBLAS "
             "programs), against the device's peak_bytes_in_use. MiB per device.", "",
             "| configuration | measured | with its choices | error | fusions / GEMMs without a choice | "
             "--target (no file) | error | Triton | cuBLAS |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        replayed = r["replay_bytes"]
        lines.append(f"| {r['label']} | {r['measured_bytes'] / MIB:,.1f} | "
                     + (f"{replayed / MIB:,.1f} | {error(r, 'replay_bytes')}" if replayed else "refused | ")
                     + f" | {len(r['fusions_without_a_choice'])} / {r['gemms_without_a_choice']}"
                     f" | {r['target_bytes'] / MIB:,.1f} | {error(r, 'target_bytes')} | "
                     f"{r['triton_bytes'] / MIB:,.1f} | {r['cublas_bytes'] / MIB:,.1f} |")
    replayed = [r for r in rows if r["replay_bytes"]]
    worst = lambda key, rs: max((abs(r[key] / r["measured_bytes"] - 1) * 100 for r in rs), default=float("nan"))
    lines += ["", "Refused: a GEMM of the step found no recorded choice (XLA would make it a Triton fusion, which is "
                  "not the device's program); `plan` then gives the larger of the two programs. Fusions without a "
                  "choice: those XLA names when asked to refuse them "
                  "(`xla_gpu_require_complete_aot_autotune_results`).",
              "", f"Largest |error|: with the recorded choices {worst('replay_bytes', replayed):.2f}% "
                  f"({len(replayed)} of {len(rows)} replayed), without them {worst('target_bytes', rows):.1f}%.", "",
              f"The run's files hold {split['fusions']} distinct fusions; {split['chosen_differently']} of them were "
              f"chosen differently by two of its runs ({split['gemms_chosen_differently']} GEMMs between cuBLAS and "
              "Triton): the autotuner times its candidates, and a close call can go either way from run to run."]
    return "\n".join(lines) + "\n"


def main() -> int:
    import jax

    from jaxseq.planning import gpu_target

    gpu_target.cpu_only()
    rows, split = replay(), disagreements()
    stem = f"autotune_replay_jax{jax.__version__}"
    (RESULTS / f"{stem}.json").write_text(json.dumps({"jax_version": jax.__version__, "runs": rows,
                                                      "disagreements": split}, indent=1) + "\n")
    (RESULTS / f"{stem}.md").write_text(table(rows, split, jax.__version__))
    print(table(rows, split, jax.__version__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
