"""Expert parallelism measured on 8 simulated devices, and the plan's MoE terms for GPUs (issue 58, item 7, in part).

    python experiments/moe.py                 # writes experiments/results/moe.{md,json} (about 12 min on 2 busy cores)
    python experiments/moe.py --render-only   # moe.md again from moe.json
    python experiments/moe.py --loads-only    # the simulated rows kept from moe.json, the rest again

1. One mixture of experts (8 experts, top-2, h = 256, f = 512, 2 layers, s = 128, float32, capacity factor 1.25)
   and global batch (16 sequences, no accumulation) at expert = E × data = 8/E for E = 1, 2, 4, 8: the compiled
   step's peak per device (arguments + outputs + temporaries − aliased), its all-to-all bytes per step per device
   (each all-to-all's buffers × the times its computation runs), and tokens/s over 5 steps on this machine's 2 cores
   (simulated devices share them: what each layout computes and moves here, not what GPUs would gain).
2. What `plan --expert E` prints after its table for Qwen3-30B-A3B on 16 H100s (EP 16) and Mixtral 8x7B on 8 (EP 8)
   and on 64 (EP 8 × t 8): parameters, state per device, the all-to-all per layer (planning/moe.py: arithmetic at
   data-sheet bandwidths, nothing compiled).
3. Tokens per expert over a run of the embedded corpus (tiny-moe, one device, float32, 16 sequences a step), with
   the balancing loss (coefficient 0.01) and without: each expert's share of the assignments of a fixed held-out
   batch, every layer, every 25 steps (a table; no plot: matplotlib is not in this venv).
Not here: `plan --search` over E (no expert dimension yet), so no prediction for Megatron-Bridge's Qwen3-30B-A3B run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "experiments" / "results"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxseq.config import OptimizerConfig, ParallelConfig, replace  # noqa: E402
from jaxseq.presets import preset  # noqa: E402
from jaxseq.hardware import HARDWARE  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.parallel.layout import Layout  # noqa: E402
from jaxseq.models import experts, moe as moe_family  # noqa: E402
from jaxseq.planning import hlo, hlo_loops, moe  # noqa: E402
from jaxseq.training import data  # noqa: E402
from jaxseq.training import aot  # noqa: E402
from jaxseq.training import train_step  # noqa: E402

MIB = 2**20
CFG = replace(preset("tiny-moe"), vocab_size=1024, seq_len=128, hidden=256, heads=8, kv_heads=2, ffn_hidden=512,
              dtype="float32")
BATCH, STEPS = 16, 5
PLANS = {  # name → (preset, tensor, expert, hardware)
    "qwen3-30b-a3b on 16 H100s, EP 16": ("qwen3-30b-a3b", 1, 16, "h100"),
    "mixtral-8x7b on 8 H100s, EP 8": ("mixtral-8x7b", 1, 8, "h100"),
    "mixtral-8x7b on 64 H100s, EP 8 × t 8": ("mixtral-8x7b", 8, 8, "h100"),
}


def all_to_all_bytes(text: str) -> float:
    """Bytes of every all-to-all per step per device: its buffers × the times its computation runs."""
    comps, runs = hlo.parse_hlo(text), hlo_loops.runs_per_call(text)
    return sum(sum(hlo.array_bytes(dt, dims) for dt, dims in ins.results()) * runs.get(comp, 0)
               for comp, instrs in comps.items() for ins in instrs
               if ins.opcode.removesuffix("-start") == "all-to-all")


def batch(step: int) -> dict:
    tokens = np.random.default_rng(step).integers(0, CFG.vocab_size, (BATCH, CFG.seq_len + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def simulated_rows() -> list[dict]:
    optimizer = train_step.make_optimizer(OptimizerConfig(lr=3e-3, warmup_steps=0), CFG)
    rows = []
    for e in (1, 2, 4, 8):
        parallel = ParallelConfig(expert=e, data=8 // e)
        layout = Layout(CFG, parallel, make_mesh(parallel))
        step = train_step.make_train_step(layout, "selective", optimizer)
        compiled = step.lower(*aot.abstract_step_inputs(layout, optimizer, BATCH)).compile()
        state = train_step.init_state(jax.random.key(0), layout, optimizer)
        state, metrics = compiled(state, batch(0), jax.random.key(1))  # warm
        float(metrics["loss"])
        start, losses = time.perf_counter(), []
        for i in range(1, STEPS + 1):
            state, metrics = compiled(state, batch(i), jax.random.key(1))
            losses.append(float(metrics["loss"]))
        seconds = (time.perf_counter() - start) / STEPS
        rows.append({"expert": e, "data": 8 // e, "step_bytes": aot.step_bytes(compiled),
                     "all_to_all_bytes": all_to_all_bytes(compiled.as_text()),
                     "tokens_per_s": BATCH * CFG.seq_len / seconds, "losses": losses})
        print(rows[-1], flush=True)
    return rows


RUN_STEPS, EVERY = 200, 25


def expert_loads() -> dict[str, list[dict]]:
    """coefficient name → [{step, shares: [layer][expert]}]: each expert's share of a held-out batch's assignments."""
    corpus = data.load_corpus(None)
    base = replace(preset("tiny-moe"), vocab_size=corpus.vocab_size, dtype="float32")
    held_out = data.Batches(corpus.val, base.seq_len, BATCH, seed=1).rows(0)["inputs"]
    out = {}
    for name, coef in (("with the balancing loss (0.01)", 0.01), ("without (0)", 0.0)):
        cfg = replace(base, moe_aux_loss_coef=coef)
        layout = Layout(cfg, ParallelConfig(), make_mesh(ParallelConfig(), jax.devices()[:1]))
        optimizer = train_step.make_optimizer(OptimizerConfig(lr=3e-3, warmup_steps=0), cfg)
        step = train_step.make_train_step(layout, "selective", optimizer)
        routing = jax.jit(lambda params, tokens, cfg=cfg: moe_family.routing(params, tokens, cfg))
        state, batches, found = train_step.init_state(jax.random.key(0), layout, optimizer), \
            data.Batches(corpus.train, cfg.seq_len, BATCH, seed=0), []
        for i in range(RUN_STEPS + 1):
            if i % EVERY == 0:
                logits = np.asarray(routing(state.params, held_out)).reshape(cfg.layers, -1, cfg.moe_experts)
                counts = [np.bincount(np.asarray(experts.route(layer, cfg)[1]).ravel(), minlength=cfg.moe_experts)
                          for layer in logits]
                found.append({"step": i, "shares": [(c / c.sum()).tolist() for c in counts]})
            if i < RUN_STEPS:
                state, _ = step(state, batches.rows(i), jax.random.key(i))
        out[name] = found
        print(name, found[-1], flush=True)
    return out


def render_loads(loads: dict[str, list[dict]]) -> list[str]:
    lines = ["## Tokens per expert over a run", "",
             f"tiny-moe (8 experts, top-2, capacity factor 1.25) on the embedded corpus, one device, float32, {BATCH} "
             f"sequences a step, lr 3e-3: each expert's share of the assignments of one held-out batch of {BATCH} "
             "sequences (an even load: 12.5% each), and the largest share over the smallest, every "
             f"{EVERY} steps."]
    for name, found in loads.items():
        last = found[-1]
        largest = ", ".join(f"{100 * max(shares):.1f}%" for shares in last["shares"])
        lines.append(f"At step {last['step']} {name}, the largest expert's share by layer: {largest}.")
    lines.append("")
    for name, found in loads.items():
        lines += [f"### {name}", "", "| step | layer | shares (%) | largest / smallest |", "| --- | --- | --- | --- |"]
        for f in found:
            for layer, shares in enumerate(f["shares"]):
                low = min(shares)
                ratio = f"{max(shares) / low:.2f}" if low > 0 else "∞ (an expert gets none)"
                lines.append(f"| {f['step']} | {layer} | " + " ".join(f"{100 * x:.1f}" for x in shares)
                             + f" | {ratio} |")
        lines.append("")
    return lines


def render(rows: list[dict], plans: dict[str, str], loads: dict[str, list[dict]]) -> str:
    lines = ["# Expert parallelism: measured on simulated devices, planned for H100s", "",
             "Made by `python experiments/moe.py`. A mixture of 8 experts (top-2, capacity factor 1.25) of h = 256, "
             f"f = 512, 2 layers, s = {CFG.seq_len}, V = {CFG.vocab_size} (float32, selective recompute), {BATCH} "
             "sequences a step, on 8 simulated CPU devices at expert = E × data = 8/E. Per device: the compiled "
             "step's peak (XLA's memory_analysis), its all-to-all bytes per step (read from the program), tokens/s "
             f"over {STEPS} steps on the 2 shared cores here.", "",
             "| expert × data | step peak (MiB) | all-to-all per step (MiB) | tokens/s (CPU) | losses |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['expert']} × {r['data']} | {r['step_bytes'] / MIB:.2f} | "
                     f"{r['all_to_all_bytes'] / MIB:.2f} | {r['tokens_per_s']:,.0f} | "
                     + ", ".join(f"{x:.4f}" for x in r["losses"]) + " |")
    same = all(r["losses"] == rows[0]["losses"] for r in rows)
    lines += ["", "At E = 1 no all-to-all runs: the experts are every rank's. Each rank routes its own tokens (its "
              "group) and drops by its own capacity; here every E has the same 8 groups (data × expert = 8), so the "
              + ("losses are the same at every E, to the digits printed." if same else
                 "losses would agree but for the order of floating-point sums; they differ here."),
              "The all-to-all's buffers are each rank's [E, C, h] whatever the expert size (so the same bytes at "
              "E = 2, 4, 8); the share that leaves the rank is (E − 1)/E of them. The peak falls as each rank holds "
              "8/E experts' weights, gradients and Adam moments.", "",
              "## What `plan --expert E` prints for GPUs (planning/moe.py)", ""]
    for name, text in plans.items():
        lines += [f"### {name}", "", "```", text, "```", ""]
    return "\n".join(lines + render_loads(loads))


def main() -> None:
    if "--render-only" in sys.argv:
        saved = json.loads((RESULTS / "moe.json").read_text())
        (RESULTS / "moe.md").write_text(render(saved["simulated"], saved["plans"], saved["loads"]))
        return
    saved = json.loads((RESULTS / "moe.json").read_text()) if "--loads-only" in sys.argv else None
    rows = saved["simulated"] if saved else simulated_rows()
    plans = {name: moe.report(preset(p), tensor=t, expert=e, context=1, micro_batch=1, microbatches=1,
                              hw=HARDWARE[hw]) for name, (p, t, e, hw) in PLANS.items()}
    loads = expert_loads()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "moe.json").write_text(json.dumps({"simulated": rows, "plans": plans, "loads": loads}, indent=1))
    (RESULTS / "moe.md").write_text(render(rows, plans, loads))
    print(render(rows, plans, loads))


if __name__ == "__main__":
    main()
