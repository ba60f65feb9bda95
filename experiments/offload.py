"""Host offload as a choice of `plan --search`: where `none` does not fit, what offloading buys against recompute.

    python experiments/offload.py                  # both cases: experiments/results/offload_<case>.json, offload.md
    python experiments/offload.py --only gpt3-1.3b  # one case again (~5 min on 2 busy cores); offload.md from all
    python experiments/offload.py --render-only

For each case below, the search (its layers compiled on simulated CPU devices, as `plan --search` compiles them)
twice over the same compiled costs: once with a budget no configuration misses (every configuration's predicted
memory and time, `none` included), and once at the GPU's memory with `--block-recompute --offload all
--offload-optimizer`: the configurations that fit, the offloaded variants among them (`planning/search_offload.py`:
composed from the configuration's evaluation, PCIe time at the hardware table's bandwidth × the link efficiency,
activations' copies overlapping compute). Nothing here is measured on a GPU: experiments/gpu.py's offload rows are.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "experiments" / "results"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxseq import plan as plan_command  # noqa: E402
from jaxseq.config import replace  # noqa: E402
from jaxseq.planning import search, search_space  # noqa: E402
from jaxseq.planning.search_costs import SearchCosts  # noqa: E402

COMMON = ["--search", "--hardware", "h100", "--attention", "fused", "--context-sizes", "1",
          "--remat-policies", "none,selective,lean,full", "--block-recompute", "--offload", "all",
          "--offload-optimizer"]
CASES = {
    "gpt3-1.3b": ["--preset", "gpt3-1.3b", "--gpus", "1", "--gpus-per-node", "1", "--global-batch", "16",
                  "--micro-batch-sizes", "16", "--tensor-sizes", "1"],
    "llama3-8b": ["--preset", "llama3-8b", "--seq-len", "8192", "--gpus", "8", "--global-batch", "8",
                  "--micro-batch-sizes", "1", "--tensor-sizes", "1", "--fsdp-sizes", "1,8"],
}


TOP = 30  # fitting configurations a table lists


def run_case(argv: list[str]) -> dict:
    """Both searches of one case over one set of compiled costs; the rows as `Evaluated.to_json` gives them."""
    args = plan_command.build_parser().parse_args(argv)
    cfg = plan_command.resolve(args)
    request = plan_command.search_request(args)
    search_space.validate_request(cfg, request)
    costs = SearchCosts(cfg, plan_command.search_devices(request))
    start = time.perf_counter()
    everything = search.search(cfg, replace(request, hardware=replace(request.hardware, memory_gib=1e6), offload=False,
                                            offload_optimizer=False), costs, args.preset)
    offered = search.search(cfg, request, costs, args.preset)
    return {"command": "python -m jaxseq.plan " + " ".join(argv), "seconds": time.perf_counter() - start,
            "budget_gib": request.hardware.memory_gib, "pcie_gb_per_s": request.hardware.pcie_gb_per_s,
            "every_configuration": [slim(e.to_json()) for e in everything.ranked],
            "fitting": [slim(e.to_json()) for e in offered.ranked]}


FIELDS = ("tensor", "pipe", "virtual", "data", "fsdp", "micro_batch", "microbatches", "schedule",
          "distributed_optimizer", "sequence_parallel", "remat", "offload", "offload_optimizer", "host_gib")


def slim(row: dict) -> dict:
    """What the tables read of `Evaluated.to_json`: the configuration, its device and host GiB, its seconds."""
    return {**{k: row[k] for k in FIELDS}, "memory_gib": {"total": row["memory_gib"]["total"]},
            "time_s": {"total": row["time_s"]["total"], "pcie": row["time_s"]["pcie"]}}


def _label(row: dict) -> str:
    return row["remat"] + ("+off" if row["offload"] else "") + ("+opt" if row["offload_optimizer"] else "")


def _line(row: dict, budget: float) -> str:
    mem, t = row["memory_gib"], row["time_s"]
    fits = "yes" if mem["total"] <= budget else "no"
    return (f"| {_label(row)} | t={row['tensor']} p={row['pipe']} v={row['virtual']} d={row['data']} f={row['fsdp']} "
            f"b={row['micro_batch']} m={row['microbatches']} {row['schedule']}"
            f"{' distopt' if row['distributed_optimizer'] else ''} | "
            f"{mem['total']:.1f} | {row['host_gib']:.1f} | {fits} | {t['total']:.3f} | {t['pcie']:.3f} |")


def render(results: dict) -> str:
    lines = ["# Host offload in the search (`experiments/offload.py`)", "",
             "Predicted, not measured: device memory GiB per GPU (the search's memory model over layers compiled by "
             "XLA:CPU), host GiB per GPU, step time s (its time model; PCIe s: what the step is charged for the "
             "copies, activations' overlapping compute), at the H100's PCIe Gen5 x16, 64 GB/s per direction "
             "(NVIDIA's data sheet: 128 GB/s both ways) × 0.8. `+off`: everything the policy stores in host memory; "
             "`+opt`: the float32 master weights and Adam moments.", ""]
    for name, r in results.items():
        budget = r["budget_gib"]
        lines += [f"## {name}", "",
                  f"`{r['command']}` ({r['seconds']:.0f} s, compiles included, on 2 shared CPU cores)", "",
                  "Every configuration without a pipeline and without offload (a budget none misses):", "",
                  "| remat | layout | device GiB | host GiB | fits | step s | PCIe s |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [_line(row, budget) for row in r["every_configuration"] if row["pipe"] == 1]
        lines += ["", f"What fits {budget:g} GiB with block recompute and offload offered, fastest first (the first "
                      f"{TOP} of {len(r['fitting'])}; all in offload_{name}.json):", "",
                  "| remat | layout | device GiB | host GiB | fits | step s | PCIe s |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [_line(row, budget) for row in r["fitting"][:TOP]] + [""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=sorted(CASES), default=None)
    p.add_argument("--render-only", action="store_true", help="offload.md from the cases' JSON files")
    args = p.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name in [] if args.render_only else [args.only] if args.only else list(CASES):
        (RESULTS / f"offload_{name}.json").write_text(json.dumps(run_case(CASES[name] + COMMON)))
    results = {name: json.loads((RESULTS / f"offload_{name}.json").read_text()) for name in CASES
               if (RESULTS / f"offload_{name}.json").exists()}
    (RESULTS / "offload.md").write_text(render(results))
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
