"""`plan --search --target`'s memory, its parts added up, against the whole train step compiled for the H100, in
each kind of layout the search ranks: one GPU, gradient accumulation, tensor parallelism + SP, the distributed
optimizer, a pipeline, FSDP and context parallelism, at gpt3-1.3b's width with 8 layers; and accumulation at Llama 3
8B's (untied embedding and LM head: two 1,002 MiB bf16 tables), 8 layers. No GPU needed.

    pip install -r requirements-gpu-target.txt
    python experiments/search_memory.py   # writes experiments/results/search_memory.{json,md} (2 min 45 s on 2 cores)

Why: the search ranks every candidate by its parts (`search_memory.memory`: the state's share of the peak, stored
bytes per layer × layers in flight, the working memory of its layer's 2-layer step, the pipeline executor's
buffers) and compiles only its best few whole (`--verify`). A candidate the parts put over the budget is never
verified, so parts that run high drop configurations that fit; parts that run low rank configurations that do not.
"float32 gradients" is the same sum with the state counted as it was before `memory.State.at_peak`: the float32
gradients at the peak, where the backward layer loop carries the compute copy's (bf16) and makes the float32 ones
only after it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "experiments" / "results"
MIB = 2**20
LAYERS = 8  # of gpt3-1.3b's layer; the parts' layer programs have two, the whole steps eight
TARGET = "h100"


MODELS = ("gpt3-1.3b", "llama3-8b")


def candidates():
    """Per model: configuration → candidate."""
    from jaxseq.planning.search_space import Candidate

    gpt = {  # Candidate(t, p, v, d, b, remat, SP, distributed optimizer, m, ...)
        "one GPU, b=2, none": Candidate(1, 1, 1, 1, 2, "none", False, False, 1),
        "one GPU, b=1, m=4 accumulated, selective": Candidate(1, 1, 1, 1, 1, "selective", False, False, 4),
        "t=2 + SP, b=2, none": Candidate(2, 1, 1, 1, 2, "none", True, False, 1),
        "t=2 + SP, d=2, distributed optimizer, b=2, lean": Candidate(2, 1, 1, 2, 2, "lean", True, True, 1),
        "d=4, distributed optimizer, b=1, m=2, full": Candidate(1, 1, 1, 4, 1, "full", False, True, 2),
        "p=2 (1F1B), b=1, m=4, selective": Candidate(1, 2, 1, 1, 1, "selective", False, False, 4),
        "FSDP f=2, b=2, selective": Candidate(1, 1, 1, 1, 2, "selective", False, False, 1, fsdp=2),
        "t=2 + SP, c=2 all-gather, b=1, selective": Candidate(2, 1, 1, 1, 1, "selective", True, False, 1, context=2),
    }
    llama = {
        "one GPU, b=1, m=2 accumulated, selective": Candidate(1, 1, 1, 1, 1, "selective", False, False, 2),
        "t=2 + SP, b=1, m=2 accumulated, selective": Candidate(2, 1, 1, 1, 1, "selective", True, False, 2),
        "t=2 + SP, d=2, distributed optimizer, b=1, m=4, full": Candidate(2, 1, 1, 2, 1, "full", True, True, 4),
    }
    return {"gpt3-1.3b": gpt, "llama3-8b": llama}


def measure() -> list[dict]:
    rows = []
    for model, configurations in candidates().items():
        rows += measure_model(model, configurations)
    return rows


def measure_model(model: str, configurations: dict) -> list[dict]:
    from jaxseq.config import on_platform, replace
    from jaxseq.presets import preset
    from jaxseq.plan import candidate_parallel
    from jaxseq.planning import gpu_target
    from jaxseq.planning import search_memory
    from jaxseq.planning.costs import costs_of
    from jaxseq.planning.memory import state_bytes
    from jaxseq.planning.search_costs import SearchCosts
    from jaxseq.training import aot

    cfg = on_platform(replace(preset(model), layers=LAYERS, attention="fused"), "gpu")
    costs = SearchCosts(cfg, gpu_target.target_devices(TARGET, 8))
    rows = []
    for label, c in configurations.items():
        start = time.perf_counter()
        layer, state = costs_of(cfg, c, costs)
        memory = search_memory.memory(cfg, c, layer, state)
        parts = memory.total_bytes
        counted = state_bytes(replace(cfg, layers=cfg.layers // c.pipe), c.tensor, c.data * c.context,
                              c.distributed_optimizer, c.pipe, c.fsdp)
        step = gpu_target.compile_step(cfg, candidate_parallel(c), c.remat, c.micro_batch, c.microbatches,
                                       TARGET)  # Triton's
        rows.append({"model": model, "configuration": label, "candidate": c.label(), "parts_bytes": parts,
                     "held_copy_bytes": memory.held_copy_bytes,
                     "float32_gradients_bytes": parts + counted.gradients - counted.loop_gradients,
                     "compiled_bytes": aot.step_bytes(step), "seconds": time.perf_counter() - start})
        print(f"{label}: parts {parts / MIB:,.0f} MiB, compiled {rows[-1]['compiled_bytes'] / MIB:,.0f} MiB",
              flush=True)
    return rows


def table(rows: list[dict], jax_version: str) -> str:
    error = lambda r, key: f"{100 * (r[key] / r['compiled_bytes'] - 1):+.1f}%"
    lines = ["# The search's memory against the whole step compiled for the H100 "
             "(`python experiments/search_memory.py`)",
             "", f"Each model's layer, {LAYERS} layers, s = 2048 (Llama 3 8B: 8192), bf16, cuDNN attention where the "
             f"layout runs it; jax {jax_version} and its CUDA plugin, no GPU. Compiled: the whole donated train step "
             "for "
             f"the {TARGET.upper()} (argument + output + temp − alias, Triton's GEMMs: what the parts' layer programs "
             "compile). Parts: `plan --search --target`'s memory (`search_memory.memory`); of them, accumulating "
             "(m > 1, no "
             "pipeline), the embedding and head tables' compute copy held beside their gradients "
             "(`search_memory.accumulation_held_copy_bytes`). float32 gradients: the same parts with the state "
             "counted as "
             "before `memory.State.at_peak`. MiB per device.", "",
             "| model | configuration | candidate | compiled | parts | error | of them, held copy | float32 gradients "
             "| error |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['configuration']} | `{r['candidate']}` | {r['compiled_bytes'] / MIB:,.0f} | "
                     f"{r['parts_bytes'] / MIB:,.0f} | {error(r, 'parts_bytes')} | {r['held_copy_bytes'] / MIB:,.0f} | "
                     f"{r['float32_gradients_bytes'] / MIB:,.0f} | {error(r, 'float32_gradients_bytes')} |")
    worst = lambda key: max(abs(r[key] / r["compiled_bytes"] - 1) for r in rows)
    lines += ["", f"Largest |error|: the parts {100 * worst('parts_bytes'):.1f}%, with float32 gradients "
              f"{100 * worst('float32_gradients_bytes'):.1f}%."]
    return "\n".join(lines) + "\n"


def main() -> int:
    from jaxseq.planning import gpu_target

    gpu_target.cpu_only()
    import jax

    rows = measure()
    out = {"jax_version": jax.__version__, "target": TARGET, "layers": LAYERS, "units": "bytes per device",
           "rows": rows}
    (RESULTS / "search_memory.json").write_text(json.dumps(out, indent=1) + "\n")
    (RESULTS / "search_memory.md").write_text(table(rows, jax.__version__))
    print(table(rows, jax.__version__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
