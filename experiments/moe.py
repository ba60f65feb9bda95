"""Expert parallelism measured on 8 simulated devices, and the plan's MoE terms for GPUs (issue 58, item 7, in part).

    python experiments/moe.py                 # writes experiments/results/moe.{md,json} (about 12 min on 2 busy cores)
    python experiments/moe.py --render-only   # moe.md and moe_loads.png again from moe.json
    python experiments/moe.py --loads-only    # the simulated rows kept from moe.json, the rest again
    python experiments/moe.py --plans-only    # only the plans' lines again (part 2: arithmetic, seconds)

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
   batch, every layer, every 25 steps: a table and results/moe_loads.png (requirements-experiments.txt).
4. `python experiments/moe.py --search-only` (about 5 min here; with --render-only, moe_search.md from its JSON):
   `plan --search` over the expert size e for Qwen3-30B-A3B on 16 H100s against Megatron-Bridge's published 8,960
   tokens/s per GPU (FP8, EP 16), and Mixtral 8x7B on 8 and 64 H100s: experiments/results/moe_search.{md,json}
   (`SEARCHES`: the assumed sequence length and global batch, and why).
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

# name → (the `plan --search` arguments, why that batch and sequence length). Every search at c = 1 (4,096 tokens gain
# nothing from splitting), bf16, the model's own sequence length, ~1M-2M tokens a step; the spaces narrowed to what the
# 2 shared cores here compile in minutes (t = 1 where the experts split over e; Mixtral also t = 8).
SEARCHES = {
    "qwen3-30b-a3b on 16 H100s": (
        ["--preset", "qwen3-30b-a3b", "--gpus", "16", "--global-batch", "512", "--hardware", "h100",
         "--tensor-sizes", "1", "--context-sizes", "1", "--expert-sizes", "1,2,4,8,16",
         "--remat-policies", "selective,full", "--micro-batch-sizes", "1,2"],
        "s = 4,096 (the preset's, Qwen3's pre-training length) and a global batch of 512 sequences (2M tokens): "
        "assumed for Megatron-Bridge's run, whose recipe is not read here; t = 1 as its EP 16 layout"),
    "mixtral-8x7b on 8 H100s": (
        ["--preset", "mixtral-8x7b", "--gpus", "8", "--global-batch", "256", "--hardware", "h100",
         "--tensor-sizes", "1,8", "--context-sizes", "1", "--expert-sizes", "1,2,4,8", "--fsdp-sizes", "1,8",
         "--remat-policies", "selective,full", "--micro-batch-sizes", "1"],
        "s = 4,096 (the preset's), a global batch of 256 sequences (1M tokens)"),
    "mixtral-8x7b on 8 H100s, optimizer state in host memory": (
        ["--preset", "mixtral-8x7b", "--gpus", "8", "--global-batch", "256", "--hardware", "h100",
         "--tensor-sizes", "1,8", "--context-sizes", "1", "--expert-sizes", "1,2,4,8",
         "--remat-policies", "selective,full", "--micro-batch-sizes", "1", "--offload-optimizer"],
        "as above, the float32 master weights and Adam moments in host memory between steps where a configuration "
        "does not fit without (+opt: --offload-optimizer)"),
    "mixtral-8x7b on 64 H100s": (
        ["--preset", "mixtral-8x7b", "--gpus", "64", "--global-batch", "256", "--hardware", "h100",
         "--tensor-sizes", "1,8", "--context-sizes", "1", "--expert-sizes", "1,2,4,8",
         "--remat-policies", "selective,full", "--micro-batch-sizes", "1"],
        "s = 4,096, a global batch of 256 sequences (1M tokens), as on 8"),
}
MEGATRON_BRIDGE_TOKENS_PER_GPU = 8960  # Qwen3-30B-A3B, 16 H100s, EP 16, FP8 (issue 58; its performance summary)


def run_search(argv: list[str], top: int = 8) -> tuple[str, dict]:
    """`plan --search argv` in-process: (its table, its JSON), from one search (one set of compiles)."""
    from jaxseq import plan as plan_command
    from jaxseq.config import replace as config_replace
    from jaxseq.planning import search
    from jaxseq.planning.search_costs import SearchCosts
    from jaxseq.planning.search_report import format_result, to_json

    args = plan_command.build_parser().parse_args(["--search", *argv])
    cfg = plan_command.resolve(args)
    request = config_replace(plan_command.search_request(args), expert_sizes=plan_command.expert_sizes(args, cfg))
    res = search.search(cfg, request, SearchCosts(cfg, plan_command.search_devices(request)), args.preset)
    out = to_json(res, top)
    out["best_per_expert_size"] = {e: next(r.to_json(moe=True) for r in res.ranked if r.candidate.expert == e)
                                   for e in request.expert_sizes if any(r.candidate.expert == e for r in res.ranked)}
    return format_result(res, top), out


def render_searches(found: dict) -> str:
    """moe_search.md: each search's command, assumption and table, and the yardstick against Megatron-Bridge."""
    lines = ["# `plan --search` over the expert size (issue 58)", "",
             "Made by `python experiments/moe.py --search-only`: each search in-process, its layers compiled by "
             "XLA:CPU on simulated devices, the time model's (docs/planning.md, \"Mixture of experts in the plan\").",
             ""]
    for name, (argv, why) in SEARCHES.items():
        out = found[name]
        if "refused" in out:
            lines += [f"## {name}", "", f"`python -m jaxseq.plan --search {' '.join(argv)}`", "", f"Assumed: {why}.",
                      "", f"Refused: `{out['refused']}`.", ""]
            continue
        best = out["json"]["ranked"][0]
        tokens = out["json"]["global_batch"] * out["json"]["seq_len"]
        per_gpu = tokens / best["time_s"]["total"] / out["json"]["gpus"]
        lines += [f"## {name}", "", f"`python -m jaxseq.plan --search {' '.join(argv)}`", "", f"Assumed: {why}.", "",
                  f"Best: e = {best['expert']}, t = {best['tensor']}, p = {best['pipe']}, d = {best['data']}, "
                  f"b = {best['micro_batch']}, {best['remat']}: {best['time_s']['total']:.3f} s a step, "
                  f"{per_gpu:,.0f} tokens/s per GPU (predicted), of which all-to-all "
                  f"{best['time_s']['all_to_all']:.3f} s.", ""]
        if name.startswith("qwen3"):
            ep16 = out["json"]["best_per_expert_size"]["16"]
            at16 = tokens / ep16["time_s"]["total"] / out["json"]["gpus"]
            lines += [f"Against Megatron-Bridge's {MEGATRON_BRIDGE_TOKENS_PER_GPU:,} tokens/s per GPU (FP8, EP 16): "
                      f"the bf16 prediction is {per_gpu / MEGATRON_BRIDGE_TOKENS_PER_GPU:.2f}× it at the search's "
                      f"choice, {at16 / MEGATRON_BRIDGE_TOKENS_PER_GPU:.2f}× at EP 16 itself ({at16:,.0f} tokens/s "
                      f"per GPU: {ep16['time_s']['all_to_all']:.1f} s of its {ep16['time_s']['total']:.1f} s step "
                      "are all-to-alls, half their bytes over InfiniBand, none overlapped).", ""]
        lines += ["The fastest that fits at each expert size:", "",
                  "| e | configuration | memory (GiB) | step (s) | tokens/s per GPU | all-to-all (s) |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for e, row in out["json"]["best_per_expert_size"].items():
            label = (f"t={row['tensor']} p={row['pipe']} v={row['virtual']} d={row['data']} b={row['micro_batch']} "
                     f"{row['remat']}{' +distopt' if row['distributed_optimizer'] else ''}"
                     f"{' +offload-opt' if row['offload_optimizer'] else ''}")
            lines.append(f"| {e} | {label} | {row['memory_gib']['total']:.1f} | {row['time_s']['total']:.3f} | "
                         f"{tokens / row['time_s']['total'] / out['json']['gpus']:,.0f} | "
                         f"{row['time_s']['all_to_all']:.3f} |")
        lines += ["", "```", out["text"], "```", ""]
    return "\n".join(lines)


def render_saved_searches() -> None:
    found = json.loads((RESULTS / "moe_search.json").read_text())
    (RESULTS / "moe_search.md").write_text(render_searches(found))


def searches() -> None:
    """Each search's table and JSON, or its one-line refusal (nothing fits), and its wall time here."""
    from jaxseq.config import ConfigError

    jax.devices()  # the backend started with 8 simulated devices (XLA_FLAGS above), which every search then shares
    found = {}
    for name, (argv, _) in SEARCHES.items():
        start = time.perf_counter()
        try:
            text, out = run_search(argv)
            found[name] = {"text": text, "json": out}
        except ConfigError as refused:
            found[name] = {"refused": str(refused)}
        found[name]["cpu_wall_s"] = time.perf_counter() - start
        print(f"{name}: {found[name]['cpu_wall_s']:.0f} s", flush=True)
    (RESULTS / "moe_search.json").write_text(json.dumps(found, indent=1))
    render_saved_searches()  # from the JSON: its expert sizes are strings there


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
             "![each expert's share of the assignments over the run](moe_loads.png)", "",
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


def plot_loads(loads: dict[str, list[dict]], path: Path) -> None:
    """Each expert's share of the held-out assignments over the run: one panel per (coefficient, layer), a line per
    expert, the even share dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = len(next(iter(loads.values()))[0]["shares"])
    fig, axes = plt.subplots(len(loads), layers, figsize=(4.5 * layers, 3.2 * len(loads)), sharex=True, sharey=True,
                             squeeze=False)
    for row, (name, found) in zip(axes, loads.items()):
        steps = [f["step"] for f in found]
        for layer, ax in enumerate(row):
            shares = np.array([f["shares"][layer] for f in found])  # [points, experts]
            for expert in range(shares.shape[1]):
                ax.plot(steps, 100 * shares[:, expert], marker=".", label=f"expert {expert}")
            ax.axhline(100 / shares.shape[1], color="black", linestyle="--", linewidth=0.8)
            ax.set_title(f"{name}, layer {layer}", fontsize=9)
            ax.set_xlabel("step")
        row[0].set_ylabel("share of assignments (%)")
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.suptitle("tiny-moe: each expert's share of a held-out batch's assignments (experiments/moe.py)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    if "--search-only" in sys.argv:
        return render_saved_searches() if "--render-only" in sys.argv else searches()
    if "--render-only" in sys.argv:
        saved = json.loads((RESULTS / "moe.json").read_text())
        (RESULTS / "moe.md").write_text(render(saved["simulated"], saved["plans"], saved["loads"]))
        plot_loads(saved["loads"], RESULTS / "moe_loads.png")
        return
    plans_only = "--plans-only" in sys.argv
    saved = json.loads((RESULTS / "moe.json").read_text()) if "--loads-only" in sys.argv or plans_only else None
    rows = saved["simulated"] if saved else simulated_rows()
    plans = {name: moe.report(preset(p), tensor=t, expert=e, context=1, micro_batch=1, microbatches=1,
                              hw=HARDWARE[hw]) for name, (p, t, e, hw) in PLANS.items()}
    loads = saved["loads"] if plans_only else expert_loads()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "moe.json").write_text(json.dumps({"simulated": rows, "plans": plans, "loads": loads}, indent=1))
    (RESULTS / "moe.md").write_text(render(rows, plans, loads))
    plot_loads(loads, RESULTS / "moe_loads.png")
    print(render(rows, plans, loads))


if __name__ == "__main__":
    main()
