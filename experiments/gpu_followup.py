"""The questions the H100 run of 2026-11-27 (`experiments/gpu.py`, results/gpu_h100_2026-11-27/) raised, measured on
one GPU in about 3 minutes:

1. Unrolled layers ran 1.44× (`none`) and 1.50× (`full`) slower than the scan, where the H100 program compiled
   offline moves 15 GB fewer bytes (experiments/scan_stacks.py). Where does the time go? `none` at micro-batch 4,
   scanned and unrolled, each traced (wall, busy, ms per kind and per op) with XLA's command buffers (CUDA graphs)
   on, as a run has them, and off, so that the trace names each kernel instead of a whole graph; the optimized HLO
   of each program is kept (`*.hlo.gz`) to read offline with planning/hlo*.py.
2. The largest micro-batches `plan --target` admitted ran out of memory in gpu.py's children, which allocated with
   growing pools (XLA_PYTHON_CLIENT_PREALLOCATE=false, the parent's setting) rather than a training run's one
   pool: `none` at micro-batch 8 and `full` at 32, preallocated, peak memory measured.
3. bf16 against float32 on the default corpus diverged after 5 steps under the timed rows' full learning rate
   from the first step; the same under a training run's warmup (`gpu.parity`).

    python experiments/gpu_followup.py --out DIR     # a GPU only; writes DIR/gpu_followup.json (+ the HLO)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_OPS = 40


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for gpu_followup.json and the programs' HLO")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--runs", nargs="+", help="only these runs, in this order (default: all)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.path[:0] = [str(ROOT), str(ROOT / "experiments")]
    import gpu

    gpu.parent_allocates_lazily()  # the children run, preallocated
    import jax

    from jaxseq.config import on_platform, replace

    is_gpu, devices = gpu.local_devices()
    if not is_gpu:
        raise SystemExit("gpu_followup.py measures a GPU; none here")
    cfg = on_platform(replace(gpu.models(True)["gpt3-1.3b"], dtype="bfloat16", attention="fused"), "gpu")
    parallel = {"tensor": 1, "sequence_parallel": False}
    base = {"micro_batch": 4, "microbatches": 1, "steps": args.steps, "warmup": 2, "parallel": parallel,
            "autotune_dir": str(gpu.autotune_dir(True, out))}  # each run's GEMM choices, to compile it offline
    result = {"device_kind": devices[0].device_kind, "jax_version": jax.__version__, "model": "gpt3-1.3b",
              "command": " ".join(["python", "experiments/gpu_followup.py", *sys.argv[1:]]), "runs": {}}

    def run(name: str, cfg, remat: str, **extra):
        print(f"{name} …", flush=True)
        start = time.perf_counter()
        row = gpu.run_spec({**base, "model": dataclasses.asdict(cfg), "remat": remat, **extra}, devices, True)
        row.pop("custom_calls", None)
        result["runs"][name] = {"remat": remat, **{k: v for k, v in extra.items() if k != "hlo_path"}, **row,
                                "wall_s": time.perf_counter() - start}
        print(f"  {json.dumps({k: v for k, v in row.items() if k in ('median_step_s', 'peak_bytes_in_use', 'error')})}",
              flush=True)

    unrolled = replace(cfg, layer_loop="unrolled")
    trace = {"profile_steps": 2, "top_ops": TOP_OPS}
    # the whole run without command buffers (gpu.py's traces alone drop them): its step time as well as its kernels
    no_command_buffers = " ".join(f"--{k}={v}" for k, v in gpu.KERNEL_BY_KERNEL.items())
    runs = {
        "unrolled_none": lambda: run("unrolled_none", unrolled, "none", **trace,
                                     hlo_path=str(out / "unrolled_none.hlo.gz")),
        "unrolled_none_no_command_buffers": lambda: run("unrolled_none_no_command_buffers", unrolled, "none", **trace,
                                                        xla_flags=no_command_buffers),
        "unrolled_full": lambda: run("unrolled_full", unrolled, "full"),
        "scan_none_no_command_buffers": lambda: run("scan_none_no_command_buffers", cfg, "none", **trace,
                                                    xla_flags=no_command_buffers,
                                                    hlo_path=str(out / "scan_none.hlo.gz")),
        "none_micro_batch_8": lambda: run("none_micro_batch_8", cfg, "none", micro_batch=8),
        "full_micro_batch_32": lambda: run("full_micro_batch_32", cfg, "full", micro_batch=32),
        "parity": lambda: result.update(parity=gpu.parity(True, cfg, {}, {**base, "steps": 6},
                                                          parallel, devices, True)),
    }
    for name in args.runs or runs:  # each run's result on disk as it comes
        runs[name]()
        (out / "gpu_followup.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
