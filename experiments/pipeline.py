"""Pipeline schedules on 8 simulated CPU devices: idle ticks, in-flight activation bytes and per-device
memory of the compiled program vs the number of micro-batches m, and CPU step time next to pipe=1.

    python experiments/pipeline.py        # writes experiments/results/pipeline.{json,txt,png} (~15 min on 2 cores)
    python experiments/pipeline.py overhead   # the executor's own cost: pipeline_overhead.{json,md} (~17 min)
    python experiments/pipeline.py anatomy    # one tick of GPT-3 175B's pipelined step (compiled only, ~30 s)
    python experiments/pipeline.py report     # pipeline_overhead.md again from the json files
    python experiments/pipeline.py stash LABEL  # the stash's traffic per step and the compiled memory (~3 min):
                                                # pipeline_stash.json under LABEL, then pipeline_stash.md

What carries the claims: the tick counts (from the schedule tables, equal to the compiled loop's trip
count) and the compiled memory (XLA's own accounting). Simulated devices share the machine's cores, so
CPU wall time is not a GPU bubble: all stages' work runs on the same 2 cores whether they idle or not,
and the measured step time says what the executor costs (ticks × per-tick overhead), not what a real
pipeline gains.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "experiments" / "results"

P, MICRO = 4, 2
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))
MS = (4, 8, 16)


def main() -> int:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as PS

    from jaxseq.training import aot
    from jaxseq.parallel import pipeline as PL
    from jaxseq.parallel.layout import Layout
    from jaxseq.parallel import ticks
    from jaxseq.planning.stash import stash_layout
    from jaxseq.training import train_step as T
    from jaxseq.config import ParallelConfig, replace
    from jaxseq.presets import preset
    from jaxseq.mesh import make_mesh

    cfg = replace(preset("tiny"), layers=8, dtype="float32")  # h=64, s=64, a=8, V=256
    remat = "selective"
    devices = jax.devices()
    rows = []
    for name, v in SCHEDULES:
        for m in MS:
            parallel = ParallelConfig(data=2, tensor=1, sequence_parallel=False, pipe=P, schedule=name,
                                      virtual_stages=v)
            mesh = make_mesh(parallel, devices)
            layout = Layout(cfg, parallel, mesh)
            sched = ticks.schedule_of(parallel, m, cfg.layers)
            params, batch = aot.abstract_inputs(layout, MICRO * m)
            key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, PS()))
            start = time.perf_counter()
            compiled = PL.make_loss_and_grad(layout, remat, m).lower(params, batch, key).compile()
            compile_s = time.perf_counter() - start
            mem = compiled.memory_analysis()
            stash, _ = stash_layout(layout, remat, m, MICRO)
            # Per device: the stash leaves are global over `data` (batch axis 2 of [k, b, s, …]).
            slot = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in stash) // parallel.data
            rows.append({
                "schedule": sched.name, "p": P, "v": v, "m": m, "ticks": sched.ticks, "idle_ticks": sched.idle_ticks,
                "bubble": sched.bubble, "paper_bubble": sched.paper_bubble,
                "stage0_chunks_in_flight": sched.in_flight(0),
                "stash_slots": sched.depths["stash"], "stash_slot_bytes": slot,
                "in_flight_activation_bytes": slot * sched.depths["stash"],
                "temp_bytes": mem.temp_size_in_bytes,
                "peak_bytes": mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
                              - mem.alias_size_in_bytes,
                "compile_s": round(compile_s, 1),
            })
            print(json.dumps(rows[-1]), flush=True)

    # CPU step time at m = 8: the train step (pipelined, or gradient accumulation at pipe=1) on the same
    # 8 devices and the same batch.
    m = 8
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (MICRO * m, cfg.seq_len + 1), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    timings = {}
    for label, parallel in [("pipe=1 data=2 tensor=4 (accumulation)", ParallelConfig(data=2, tensor=4,
                                                                                     sequence_parallel=False)),
                            *[(f"pipe={P} data=2 {n} v={v}", ParallelConfig(data=2, tensor=1, sequence_parallel=False,
                                                                            pipe=P, schedule=n,
                                                                              virtual_stages=v))
                              for n, v in SCHEDULES]]:
        layout = Layout(cfg, parallel, make_mesh(parallel, devices))
        opt = optax.sgd(0.0)
        state = T.init_state(jax.random.key(0), layout, opt)
        step = T.make_train_step(layout, remat, opt, micro_batches=m, donate=False)
        state2, out = step(state, batch, jax.random.key(1))  # compile
        jax.block_until_ready(out)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            jax.block_until_ready(step(state, batch, jax.random.key(1))[1])
            times.append(time.perf_counter() - start)
        timings[label] = {"median_s": statistics.median(times), "loss": float(out["loss"])}
        print(label, timings[label], flush=True)

    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"model": "tiny, layers=8, float32, selective remat", "micro_batch": MICRO, "mesh": "pipe=4 × data=2",
           "rows": rows, "cpu_step_time_m8": timings,
           "units": "bytes per device; ticks per step; seconds per step (8 simulated devices on 2 shared cores)"}
    (RESULTS / "pipeline.json").write_text(json.dumps(out, indent=1))
    lines = [f"{'schedule':<12}{'v':>2}{'m':>4}{'ticks':>7}{'idle':>6}{'bubble':>8}{'paper':>8}{'held':>6}"
             f"{'in-flight KiB':>15}{'temp KiB':>10}{'peak KiB':>10}"]
    for r in rows:
        lines.append(f"{r['schedule']:<12}{r['v']:>2}{r['m']:>4}{r['ticks']:>7}{r['idle_ticks']:>6}{r['bubble']:>8.4f}"
                     f"{r['paper_bubble']:>8.4f}{r['stage0_chunks_in_flight']:>6}"
                     f"{r['in_flight_activation_bytes'] / 1024:>15.1f}{r['temp_bytes'] / 1024:>10.1f}"
                     f"{r['peak_bytes'] / 1024:>10.1f}")
    lines.append("")
    lines += [f"CPU step time, m=8: {k}: {t['median_s']:.3f} s (loss {t['loss']:.6f})" for k, t in timings.items()]
    (RESULTS / "pipeline.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, v in SCHEDULES:
        rs = [r for r in rows if r["schedule"] == name]
        axes[0].plot([r["m"] for r in rs], [r["temp_bytes"] / 1024 for r in rs], marker="o", label=f"{name} v={v}")
        axes[1].plot([r["m"] for r in rs], [r["bubble"] for r in rs], marker="o", label=f"{name} v={v}")
    axes[0].set(xlabel="micro-batches m", ylabel="compiled temp memory per device (KiB)",
                title=f"p={P}: 1F1B flat in m, GPipe linear")
    axes[1].set(xlabel="micro-batches m", ylabel="bubble = idle / busy ticks", title="(p−1)/m and (p−1)/(v·m)")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / "pipeline.png", dpi=120)
    return 0


# ---------------------------------------------------------------------------------------------
# The executor's own overhead: `python experiments/pipeline.py overhead`

OVERHEAD_M = 8
OVERHEAD_SIZES = {  # name → model overrides on the tiny preset (float32, 8 layers, selective remat)
    "h64-s64": {},
    "h256-s256": {"hidden": 256, "seq_len": 256},
}


def _bytes(ins) -> int:
    from jaxseq.planning import hlo

    return sum(hlo.array_bytes(dt, dims) for dt, dims in ins.arrays())


def tick_loop_anatomy(text: str, ticks: int) -> dict:
    """What one tick runs outside its lax.switch, read from the compiled tick loop's body: bytes written per
    tick by kind (ppermute sends, stash/receive-buffer slot writes, slot reads, gradient accumulation), and
    the dot FLOPs of each switch branch."""
    from jaxseq.planning import hlo, hlo_flops, hlo_loops

    comps = hlo.parse_hlo(text)
    body = hlo_loops.while_loop(comps, ticks).attr("body")
    out = {"ppermute": 0, "slot_writes": 0, "slot_reads": 0, "grad_accumulation": 0, "buffer_copies": 0, "other": 0}
    counts = dict.fromkeys(out, 0)
    branches = None
    for ins in comps[body]:
        if ins.opcode == "conditional":
            memo = {}
            branches = [hlo_flops.dot_flops(comps, b, memo) for b in ins.branches()]
            continue
        if ins.opcode in ("get-tuple-element", "constant", "tuple", "parameter", "bitcast"):
            continue
        kind, nbytes = "other", _bytes(ins)
        if ins.opcode == "collective-permute":
            kind = "ppermute"
        elif ins.opcode == "copy":
            kind = "buffer_copies"
        elif ins.opcode == "fusion":
            fused = comps[ins.attr("calls")]
            ops = {i.opcode for i in fused}
            root = fused[-1]
            if root.opcode == "dynamic-update-slice":  # in place: only the update is written (XLA:CPU's bf16
                # buffers are not: convert + dynamic-update-slice + convert, root convert, counted whole as "other")
                update = {i.name: i for i in fused}[root.operands()[1]]
                # v > 1: a chunk's weight gradients are added into a [v, k, …] accumulator in place
                kind, nbytes = ("grad_accumulation" if "add" in ops else "slot_writes"), _bytes(update)
            elif "dynamic-slice" in ops and not ins.shape.startswith(("s32", "pred")):
                kind = "slot_reads"
            elif ins.shape.startswith("f") and ops & {"add"}:
                kind = "grad_accumulation"
                if "select" not in ops:  # not a chunk's slice of the layer gradients: embedding, final LN, loss
                    out["grad_accumulation_non_layer"] = out.get("grad_accumulation_non_layer", 0) + nbytes
        if kind == "other" and ins.shape.startswith(("s32[", "pred[", "u32[")) and nbytes <= 64:
            continue  # the tick's index arithmetic
        out[kind] += nbytes
        counts[kind] += 1
    return {"bytes_per_tick": out, "ops_per_tick": counts, "branch_dot_flops": branches}


def overhead() -> int:
    """The executor's own cost, three ways: (a) dot FLOPs executed (per branch × the tick table) against the
    same micro-batches unpipelined; (b) CPU time of the compiled train step, pipelined vs pipe=1 on the same
    batch, per tick; (c) what a tick does outside its switch branch, from the compiled HLO."""
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as PS

    from jaxseq.training import aot
    from jaxseq.planning import hlo, hlo_flops
    from jaxseq.parallel import pipeline as PL
    from jaxseq.parallel.layout import Layout
    from jaxseq.parallel import ticks
    from jaxseq.training import train_step as T
    from jaxseq.config import ParallelConfig, replace
    from jaxseq.presets import preset
    from jaxseq.mesh import make_mesh

    devices, m, remat = jax.devices(), OVERHEAD_M, "selective"
    results = {"micro_batch": MICRO, "microbatches": m, "remat": remat, "sizes": {},
               "load_average_start": os.getloadavg(),
               "units": "FLOPs per data rank (sum over stages) per step; bytes per device per tick; CPU seconds "
                        "per step (process time, all threads; 8 simulated devices on 2 shared cores)"}
    for size, overrides in OVERHEAD_SIZES.items():
        cfg = replace(preset("tiny"), layers=8, dtype="float32", **overrides)
        plain = ParallelConfig(data=2, tensor=1, sequence_parallel=False)
        unpiped = aot.compile_loss_and_grad(cfg, plain, remat, make_mesh(plain, devices[:2]), MICRO)
        one_mb = hlo_flops.program_dot_flops(unpiped.as_text())
        rows = []
        configs = [("pipe=1 data=2 (2 devices)", plain, devices[:2]),
                   ("pipe=1 data=2 tensor=4", ParallelConfig(data=2, tensor=4, sequence_parallel=False), devices)]
        configs += [(f"pipe={P} data=2 {n} v={v}", ParallelConfig(data=2, tensor=1, sequence_parallel=False, pipe=P,
                                                                  schedule=n, virtual_stages=v),
                     devices) for n, v in SCHEDULES]
        tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (MICRO * m, cfg.seq_len + 1), dtype=np.int32)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        for label, parallel, devs in configs:
            mesh = make_mesh(parallel, devs)
            layout = Layout(cfg, parallel, mesh)
            row = {"config": label}
            if parallel.pipe > 1:
                sched = ticks.schedule_of(parallel, m, cfg.layers)
                params, abstract_batch = aot.abstract_inputs(layout, MICRO * m)
                key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, PS()))
                compiled = PL.make_loss_and_grad(layout, remat, m).lower(params, abstract_batch, key).compile()
                text = compiled.as_text()
                anatomy = tick_loop_anatomy(text, sched.ticks)
                branch = anatomy["branch_dot_flops"]
                table = ticks.tick_rows(sched)[:, :, 0]  # [ticks, p]: the branch each stage takes
                per_stage = [float(sum(branch[b] for b in table[:, s])) for s in range(sched.p)]
                comps = hlo.parse_hlo(text)
                # the tick loop at its dearest branch × ticks
                everything = hlo_flops.dot_flops(comps, hlo.entry_name(text))
                loop_max = sched.ticks * max(branch)
                outside = everything - loop_max
                cost = compiled.cost_analysis()
                cost = cost[0] if isinstance(cost, (list, tuple)) else cost
                row.update({
                    "ticks": sched.ticks, "idle_ticks_per_stage": sched.idle_ticks,
                    "busy_ticks_per_stage": sched.busy_ticks,
                    "executed_dot_flops_per_stage": per_stage,
                    "outside_loop_dot_flops_per_device": outside,
                    "executed_dot_flops": sum(per_stage) + sched.p * outside,
                    "unpipelined_dot_flops": m * one_mb,
                    "cost_analysis_flops": float(cost["flops"]),
                    **anatomy,
                    "branch_dot_flops": dict(zip(BRANCHES, branch)),
                })
                row["flop_overhead_pct"] = 100 * (row["executed_dot_flops"] / row["unpipelined_dot_flops"] - 1)
            # CPU time of the train step on the real batch (sgd(0): the optimizer is the same for every row).
            opt = optax.sgd(0.0)
            state = T.init_state(jax.random.key(0), layout, opt)
            step = T.make_train_step(layout, remat, opt, micro_batches=m, donate=False)
            jax.block_until_ready(step(state, batch, jax.random.key(1))[1])  # compile + warm up
            cpu, wall = [], []
            for _ in range(5):
                c0, w0 = time.process_time(), time.perf_counter()
                out = step(state, batch, jax.random.key(1))[1]
                jax.block_until_ready(out)
                cpu.append(time.process_time() - c0)
                wall.append(time.perf_counter() - w0)
            row.update({"cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall), "loss": float(out["loss"]),
                        "load_average": os.getloadavg()})
            rows.append(row)
            print(size, json.dumps({k: v for k, v in row.items() if not isinstance(v, dict)}), flush=True)
        base = rows[0]["cpu_s"]
        for row in rows:
            row["cpu_over_unpipelined"] = row["cpu_s"] / base
            if "ticks" in row:
                row["extra_cpu_s_per_tick"] = (row["cpu_s"] - base) / row["ticks"]
        results["sizes"][size] = {"model": f"tiny preset, {overrides or 'h=64 s=64'}, 8 layers, float32, V=256",
                                  "one_microbatch_dot_flops": one_mb, "rows": rows}
    results["load_average_end"] = os.getloadavg()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "pipeline_overhead.json").write_text(json.dumps(results, indent=1))
    (RESULTS / "pipeline_overhead.md").write_text(overhead_markdown(results))
    print(overhead_markdown(results))
    return 0


BRANCHES = ("idle", "forward", "forward_first", "forward_last", "backward", "backward_first")  # ticks.Branch


def overhead_markdown(r: dict) -> str:
    lines = [f"# Pipeline executor overhead (p={P}, data=2, m={r['microbatches']}, micro-batch {r['micro_batch']}, "
             f"{r['remat']} remat)", "",
             "Written by `python experiments/pipeline.py overhead`. 8 simulated CPU devices share 2 cores: the CPU "
             "time is the total work of all stages, not a GPU step time (a GPU pipeline runs stages concurrently, and "
             "idle ticks cost time there, not work). "
             f"Load average: {r['load_average_start'][0]:.2f} at start, {r['load_average_end'][0]:.2f} at end.", ""]
    for size, s in r["sizes"].items():
        lines += [f"## {s['model']}", "",
                  "| config | ticks | idle/stage | dot FLOPs executed / unpipelined | CPU s/step | × pipe=1 (2 dev) "
                  "| extra CPU ms/tick | wall s | loss |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for row in s["rows"]:
            flops = (f"{row['executed_dot_flops'] / 1e9:.4f} / {row['unpipelined_dot_flops'] / 1e9:.4f} GFLOP "
                     f"({row['flop_overhead_pct']:+.3f}%)" if "ticks" in row else "-")
            lines.append(f"| {row['config']} | {row.get('ticks', '-')} | {row.get('idle_ticks_per_stage', '-')} | "
                         f"{flops} | {row['cpu_s']:.3f} | {row['cpu_over_unpipelined']:.2f} | "
                         + (f"{1e3 * row['extra_cpu_s_per_tick']:.2f}" if "ticks" in row else "-")
                         + f" | {row['wall_s']:.3f} | {row['loss']:.6f} |")
        lines += ["", "What one tick does outside its switch branch, per device, from the compiled tick loop (ops and "
                      "the bytes they write; every tick, whatever the branch):", "",
                  "| config | ppermute sends | stash/receive slot writes | slot reads | gradient accumulation (of it "
                  "embedding/final LN) | whole-buffer copies | forward branch dot FLOPs | backward branch dot FLOPs |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for row in s["rows"]:
            if "ticks" not in row:
                continue
            b, n = row["bytes_per_tick"], row["ops_per_tick"]
            br = row["branch_dot_flops"]
            br = br if isinstance(br, dict) else dict(zip(BRANCHES, br))
            lines.append(f"| {row['config']} | {n['ppermute']} = {b['ppermute'] / 1024:.1f} KiB | "
                         f"{n['slot_writes']} = {b['slot_writes'] / 1024:.1f} KiB | {n['slot_reads']} = "
                         f"{b['slot_reads'] / 1024:.1f} KiB | {n['grad_accumulation']} = "
                         f"{b['grad_accumulation'] / 1024:.1f} KiB "
                         f"({b.get('grad_accumulation_non_layer', 0) / 1024:.1f}) | "
                         f"{n.get('buffer_copies', 0)} = {b.get('buffer_copies', 0) / 1024:.1f} KiB | "
                         f"{br['forward'] / 1e6:.2f} M | "
                         f"{br['backward'] / 1e6:.2f} M |")
        lines.append("")
    lines += paper_anatomy_markdown()
    lines += ["## Reading", "", *OVERHEAD_READING]
    for size, s in r["sizes"].items():
        rows = [row for row in s["rows"] if "ticks" in row]
        lines.append(f"- CPU time, {size}: pipelined / pipe=1 (2 devices) = "
                     + ", ".join(f"{row['config'].split()[2]} {row['cpu_over_unpipelined']:.2f}" for row in rows)
                     + " (" + ", ".join(f"{1e3 * row['extra_cpu_s_per_tick']:+.1f}" for row in rows)
                     + " ms per tick), at load averages "
                     + ", ".join(f"{row['load_average'][0]:.1f}" for row in s["rows"]) + ".")
    return "\n".join(lines)


H100_HBM_BYTES_S = 3.35e12  # H100 SXM spec-sheet HBM3 bandwidth (its dense bf16 peak: jaxseq/hardware.py)


def paper_anatomy_markdown() -> list[str]:
    from jaxseq import hardware

    h100_bf16_flops = hardware.GPUS["h100"].peak_tflops * 1e12
    path = RESULTS / "pipeline_anatomy_gpt3-175b.json"
    if not path.exists():
        return []
    a = json.loads(path.read_text())
    k_c, k = a["compiled_layers_per_chunk"], a["real_layers_per_chunk"]
    b, br = a["bytes_per_tick"], a["branch_dot_flops"]
    scale = k / k_c
    layer_grads = b["grad_accumulation"] - b["grad_accumulation_non_layer"]
    stash = b["slot_writes"] + b["slot_reads"]  # float32 here; bf16 activations on a GPU: half
    rows = [("ppermute sends (2 × one activation)", b["ppermute"], 1.0),
            ("stash + receive slots, read and written back (f32 here; bf16 half)", stash, scale),
            ("chunk weight-gradient accumulation (f32)", layer_grads, scale),
            ("embedding / final-LN gradient accumulation (f32, V/t × h)", b["grad_accumulation_non_layer"], 1.0),
            ("whole-buffer copies", b["buffer_copies"], scale)]
    lines = [f"## Paper size: {a['model']}, p = t = {a['p']}, {a['schedule']}, m = {a['m']}", "",
             f"`python experiments/pipeline.py anatomy` compiles the pipelined step on 64 simulated devices with {k_c} "
             f"layers per chunk (nothing runs) and reads one tick; below, the bytes scaled to the real {k} layers per "
             "chunk where they scale with it. The time columns are estimates, not measurements: bytes × 2 (read and "
             f"write) at {H100_HBM_BYTES_S / 1e12:.2f} TB/s against the tick's dot FLOPs at "
             f"{h100_bf16_flops / 1e12:.0f} "
             "TFLOP/s (H100 SXM spec-sheet peaks; real kernels reach less of both).", "",
             f"| per tick, per device | bytes written at {k} layers/chunk | est. ms |", "| --- | --- | --- |"]
    total = 0.0
    for label, nbytes, factor in rows:
        ms = 1e3 * 2 * nbytes * factor / H100_HBM_BYTES_S
        total += ms
        lines.append(f"| {label} | {nbytes * factor / 2**20:,.0f} MiB | {ms:.2f} |")
    fwd, bwd = 1e3 * br[1] * scale / h100_bf16_flops, 1e3 * br[4] * scale / h100_bf16_flops
    lines += [f"| **all of the above** | | **{total:.2f}** |",
              f"| forward branch: {br[1] * scale / 1e12:.1f} TFLOP of dots | | {fwd:.1f} |",
              f"| backward branch: {br[4] * scale / 1e12:.1f} TFLOP of dots | | {bwd:.1f} |", "",
              f"So at GPT-3 175B the executor's per-tick traffic is ~{100 * total / fwd:.0f}% of a forward tick's and "
              f"~{100 * total / bwd:.0f}% of a backward tick's matmul time at peak (every tick pays it, idle ones "
              "too).",
              ""]
    return lines


OVERHEAD_READING = [
    "- **FLOPs**: the dot FLOPs every stage executes (each switch branch's dots, from the compiled HLO, × how often "
    "the tick table takes it) sum to exactly those of the same micro-batches unpipelined, for all three schedules: "
    "the executor adds no matmul work, idle ticks run the idle branch (no dots), and interleaving only splits the "
    "work into more, smaller ticks. `cost_analysis()` cannot say this: it counts a loop body once and a "
    "conditional at its dearest branch (the `cost_analysis_flops` field, for the record).",
    "- **Where the overhead goes** is memory traffic outside the branch, on every tick and every stage whatever "
    "the branch (the tables above): two ppermutes of one activation each (a stage runs F or B, so one of the two "
    "always carries zeros, and idle stages send zeros both ways); one stash slot read out and written back (every "
    "leaf, also on backward and idle ticks, where it comes back unchanged); the receive slots; and the gradient "
    "accumulators: the chunk's f32 weight gradients and the embedding / final-LN gradients get a read-add-write "
    "every tick although only backward ticks (and the first / last chunk) add non-zeros. At GPT-3 175B the "
    "weight-gradient accumulator dominates (the stage's whole f32 gradient, 10 GiB, per tick): the estimate above "
    "puts the tick's executor traffic near the forward tick's matmul time at peak rates. Gradient accumulation "
    "without a pipeline pays that add once per micro-batch; here it is paid 2mv + 2(p − 1) times instead of mv.",
    "- **Cheap cuts** (not made here: the executor is being changed in parallel; each needs checking that XLA keeps "
    "the buffer in place under a `lax.cond`): add a chunk's weight gradients only on backward ticks (a `lax.cond` "
    "on the branch around the in-place add, or the add of the one chunk inside the backward branch): "
    "(2m + 2(p − 1))/m = 2–4× less accumulator traffic (v = 1); write the stash slot only on forward ticks and read it "
    "only on backward ticks: half the stash traffic; add the embedding / final-LN gradients only on the first chunk's "
    "backward and the last chunk's forward. The ppermutes (24 MiB per tick at 175B) are negligible. The first "
    "and third were tried on a copy of the executor (h = 256, 1F1B, p = 4, m = 8: a `lax.cond` on the branch "
    "number around each of the two accumulations in `tick`): XLA:CPU kept both accumulators in place (no buffer "
    "copies in the conditionals), loss and gradients came out identical, temp memory +384 bytes, and the "
    "accumulation bytes written outside the switch per tick went from 6.5 MiB to 0; CPU time per step did not "
    "move (7.09, 7.00 s before; 7.06, 6.93 s after, alternating runs at load ~7.5): the CPU is not bound by these "
    "bytes, and the saving is the GPU estimate above, not a measurement.",
    "- **CPU time** is the total work of all simulated devices (process time, all threads), so it measures "
    "overhead, not a bubble: idle ticks cost no CPU here, while on GPUs they cost time and no work. The two CPU "
    "lines below are indicative only: the machine's load average was 10–19 on its 2 cores during the runs (other "
    "agents' jobs), and the programs differ beyond the executor (pipe=1 reduces gradients over data once per "
    "micro-batch, the pipelined step per backward tick). At h = 64 the pipelined step took less CPU than pipe=1, at "
    "h = 256 more; the difference per tick is the executor's cost on this CPU, larger than its bytes alone explain "
    "at CPU memory bandwidth (not established where the rest goes: XLA:CPU's per-op and collective overheads with "
    "8 devices on 2 cores are candidates).",
]


def refresh_anatomy() -> int:
    """`python experiments/pipeline.py overhead-anatomy`: recompile the pipelined rows of pipeline_overhead.json
    and redo their tick anatomy and FLOP counts (the CPU timings are kept), then the markdown."""
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as PS

    from jaxseq.training import aot
    from jaxseq.parallel import pipeline as PL
    from jaxseq.parallel.layout import Layout
    from jaxseq.parallel import ticks
    from jaxseq.config import ParallelConfig, replace
    from jaxseq.presets import preset
    from jaxseq.mesh import make_mesh

    results = json.loads((RESULTS / "pipeline_overhead.json").read_text())
    for size, overrides in OVERHEAD_SIZES.items():
        cfg = replace(preset("tiny"), layers=8, dtype="float32", **overrides)
        for row in results["sizes"][size]["rows"]:
            if "ticks" not in row:
                continue
            name, v = next((n, v) for n, v in SCHEDULES if f" {n} v={v}" in row["config"])
            parallel = ParallelConfig(data=2, tensor=1, sequence_parallel=False, pipe=P, schedule=name,
                                      virtual_stages=v)
            mesh = make_mesh(parallel, jax.devices())
            layout = Layout(cfg, parallel, mesh)
            m = results["microbatches"]
            sched = ticks.schedule_of(parallel, m, cfg.layers)
            params, batch = aot.abstract_inputs(layout, MICRO * m)
            key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, PS()))
            text = PL.make_loss_and_grad(layout, results["remat"], m).lower(params, batch, key).compile().as_text()
            anatomy = tick_loop_anatomy(text, sched.ticks)
            row.update({**anatomy, "branch_dot_flops": dict(zip(BRANCHES, anatomy["branch_dot_flops"]))})
            print(size, row["config"], anatomy["bytes_per_tick"], flush=True)
    (RESULTS / "pipeline_overhead.json").write_text(json.dumps(results, indent=1))
    return report()


def report() -> int:
    """`python experiments/pipeline.py report`: pipeline_overhead.md again from pipeline_overhead.json."""
    (RESULTS / "pipeline_overhead.md").write_text(
        overhead_markdown(json.loads((RESULTS / "pipeline_overhead.json").read_text())))
    return 0


def paper_anatomy() -> int:
    """`python experiments/pipeline.py anatomy`: the tick anatomy of GPT-3 175B's pipelined step (p = t = 8,
    TP+SP+selective, 1F1B, m = 8), compiled on 64 simulated devices with 2 layers per chunk (nothing runs)."""
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=64"
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as PS

    from jaxseq.training import aot
    from jaxseq.parallel import pipeline as PL
    from jaxseq.parallel.layout import Layout
    from jaxseq.parallel import ticks
    from jaxseq.config import ParallelConfig, replace
    from jaxseq.presets import preset
    from jaxseq.mesh import make_mesh

    p, t, m, k_c, k = 8, 8, 8, 2, 12
    cfg = replace(preset("gpt3-175b"), layers=p * k_c, dtype="float32")  # see the units note
    parallel = ParallelConfig(data=1, tensor=t, sequence_parallel=True, pipe=p, schedule="1f1b")
    mesh = make_mesh(parallel, jax.devices()[:p * t])
    layout = Layout(cfg, parallel, mesh)
    sched = ticks.schedule_of(parallel, m, cfg.layers)
    params, batch = aot.abstract_inputs(layout, m)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, PS()))
    compiled = PL.make_loss_and_grad(layout, "selective", m).lower(params, batch, key).compile()
    anatomy = tick_loop_anatomy(compiled.as_text(), sched.ticks)
    out = {"model": "gpt3-175b, float32, micro-batch 1, TP+SP+selective", "p": p, "t": t, "m": m, "schedule": "1f1b",
           "compiled_layers_per_chunk": k_c, "real_layers_per_chunk": k, "ticks": sched.ticks, **anatomy,
           "units": "per device per tick; bytes at 2 layers per chunk (slot and chunk-gradient bytes scale with "
                    "layers per chunk, ppermute and embedding-gradient bytes do not); float32 because XLA:CPU "
                    "rewrites a bf16 dynamic-update-slice as convert + update + convert of the whole buffer and "
                    "copies every bf16 stash buffer each tick, which a GPU compile does not (bf16 bytes are half of "
                    "these activation bytes; gradient accumulators are float32 either way)"}
    (RESULTS / "pipeline_anatomy_gpt3-175b.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    return 0


# ---------------------------------------------------------------------------------------------
# The stash's traffic: `python experiments/pipeline.py stash LABEL`


def stash_traffic(text: str, sched, k: int, stage: int = 0) -> dict:
    """Bytes per step that one device (stage `stage`) reads from and writes into the stash buffers of the
    compiled tick loop (the carry's [slots, k, b, …] arrays): every dynamic-slice of a stash buffer (a read of
    its slot) and dynamic-update-slice into one (a write of the update), found through the loop body, the
    tuples, fusions and conditionals that pass the buffers on, each × the ticks it runs on: the body's every
    tick, branch j of the tick's switch the ticks the stage takes branch j, and a lax.cond that returns the stash
    (the write) its true branch on the forward ticks. XLA writes a slot as a fusion that also reads the slot it
    replaces: that read is counted."""
    import re
    from collections import Counter

    from jaxseq.parallel import ticks
    from jaxseq.planning import hlo, hlo_loops

    comps = hlo.parse_hlo(text)
    loop = hlo_loops.while_loop(comps, sched.ticks)
    carry = loop.arrays()
    index = lambda ins: int(re.search(r"index=(\d+)", ins.rest).group(1))
    stash_at = {n for n, (dt, dims) in enumerate(carry) if len(dims) > 3 and dims[:2] == (sched.depths["stash"], k)}
    shapes = {carry[n] for n in stash_at}
    taken = Counter(int(b) for b in ticks.tick_rows(sched)[:, stage, 0])
    forward_ticks = sum(taken[b] for b in (ticks.Branch.FORWARD, ticks.Branch.FORWARD_FIRST, ticks.Branch.FORWARD_LAST))
    moved = Counter()

    def visit(comp: str, stash: set, runs: int):
        by_name, tuples = {i.name: i for i in comps[comp]}, {}
        for ins in comps[comp]:
            ops = ins.operands()
            if ins.opcode == "tuple" and any(o in stash for o in ops):
                tuples[ins.name] = {n for n, o in enumerate(ops) if o in stash}
            elif ins.opcode == "dynamic-slice" and ops[0] in stash:
                moved["read"] += runs * sum(hlo.array_bytes(*a) for a in ins.arrays())
            elif ins.opcode == "dynamic-update-slice" and ops[0] in stash:
                moved["write"] += runs * sum(hlo.array_bytes(*a) for a in by_name[ops[1]].arrays())
                stash.add(ins.name)
            elif ins.opcode == "fusion" and any(o in stash for o in ops):
                callee = ins.attr("calls")
                params = {int(i.rest.split(")")[0]): i.name for i in comps[callee] if i.opcode == "parameter"}
                visit(callee, {params[n] for n, o in enumerate(ops) if o in stash}, runs)
            elif ins.opcode == "conditional":
                branches = ins.branches()
                for j, branch in enumerate(branches):
                    if ops[j + 1] not in tuples:
                        continue
                    if len(branches) > 2:  # the tick's switch: branch j on the ticks of pipeline.Branch j
                        n = taken[j]
                    else:  # a lax.cond returning the stash: the write, on forward ticks (0: false, 1: true)
                        assert any(a in shapes for a in ins.arrays()), ins.name
                        n = forward_ticks if j == 1 else sched.ticks - forward_ticks
                    param = next(i.name for i in comps[branch] if i.opcode == "parameter")
                    visit(branch, {i.name for i in comps[branch] if i.opcode == "get-tuple-element"
                                   and i.operands() == [param] and index(i) in tuples[ops[j + 1]]}, n)

    body = comps[loop.attr("body")]
    param = next(i.name for i in body if i.opcode == "parameter")
    visit(loop.attr("body"), {i.name for i in body if i.opcode == "get-tuple-element" and i.operands() == [param]
                              and index(i) in stash_at}, sched.ticks)
    slot = sum(hlo.array_bytes(*carry[n]) for n in stash_at) // sched.depths["stash"]
    return {"read_bytes": moved["read"], "write_bytes": moved["write"], "slot_bytes": slot, "ticks": sched.ticks,
            "forward_ticks": forward_ticks}


STASH_CONFIGS = {  # name → (model overrides on the tiny preset, 8 layers, float32; schedule, v)
    "h256-s256 1f1b": ({"hidden": 256, "seq_len": 256}, "1f1b", 1),
    "h256-s256 interleaved": ({"hidden": 256, "seq_len": 256}, "interleaved", 2),
}


def stash(label: str) -> int:
    """`python experiments/pipeline.py stash LABEL`: the stash traffic per step (`stash_traffic`) and the compiled
    temp bytes of the pipelined loss-and-gradient program: p = 4, data = 2, m = 8 for the tiny preset at h = s =
    256 (8 simulated devices), and GPT-3 175B at p = t = 8 (1F1B, m = 8, TP+SP+selective, 64 simulated devices,
    2 layers per chunk; bytes per step scaled to its 12 layers per chunk where they scale). Run it once on each
    version of the executor (LABEL: which), from that version's tree; pipeline_stash.md compares the labels."""
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=64"
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as PS

    from jaxseq.config import ParallelConfig, replace
    from jaxseq.presets import preset
    from jaxseq.mesh import make_mesh
    from jaxseq.parallel import pipeline as PL
    from jaxseq.parallel.layout import Layout
    from jaxseq.parallel import ticks
    from jaxseq.training import aot

    def measure(cfg, parallel, m, micro, remat):
        mesh = make_mesh(parallel, jax.devices()[:parallel.num_devices])
        layout = Layout(cfg, parallel, mesh)
        sched = ticks.schedule_of(parallel, m, cfg.layers)
        params, batch = aot.abstract_inputs(layout, micro * m)
        key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, PS()))
        compiled = PL.make_loss_and_grad(layout, remat, m).lower(params, batch, key).compile()
        k = cfg.layers // (parallel.pipe * parallel.virtual_stages)
        return {**stash_traffic(compiled.as_text(), sched, k),
                "temp_bytes": compiled.memory_analysis().temp_size_in_bytes}

    rows = {}
    for name, (overrides, schedule, v) in STASH_CONFIGS.items():
        cfg = replace(preset("tiny"), layers=8, dtype="float32", **overrides)
        parallel = ParallelConfig(data=2, tensor=1, sequence_parallel=False, pipe=P, schedule=schedule,
                                  virtual_stages=v)
        rows[name] = measure(cfg, parallel, OVERHEAD_M, MICRO, "selective")
        print(label, name, rows[name], flush=True)
    p, t, k_c = 8, 8, 2
    cfg = replace(preset("gpt3-175b"), layers=p * k_c, dtype="float32")
    parallel = ParallelConfig(data=1, tensor=t, sequence_parallel=True, pipe=p, schedule="1f1b")
    rows["gpt3-175b p=t=8 1f1b (2 layers/chunk)"] = measure(cfg, parallel, 8, 1, "selective")
    print(label, rows["gpt3-175b p=t=8 1f1b (2 layers/chunk)"], flush=True)
    path = RESULTS / "pipeline_stash.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results[label] = {"rows": rows, "units": "bytes per device: read/write per step (stage 0), temp in the program"}
    path.write_text(json.dumps(results, indent=1))
    (RESULTS / "pipeline_stash.md").write_text(stash_markdown(results))
    return 0


def stash_markdown(results: dict) -> str:
    lines = ["# The pipeline executor's stash traffic and memory", "",
             "Written by `python experiments/pipeline.py stash LABEL`, run on each version of the executor. Read from "
             "the compiled pipelined loss-and-gradient program (nothing runs): the bytes one device (stage 0) reads "
             "from and writes into its stash buffers per step (`stash_traffic`: every dynamic-slice / dynamic-update-"
             "slice of a stash buffer × the ticks its computation runs on), and XLA's temp bytes per device. The "
             "GPT-3 175B row is compiled with 2 layers per chunk (its real 12 scale the stash bytes ×6).", "",
             "| executor | config | ticks (forward) | slot | stash read / step | stash written / step | temp |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, r in results.items():
        for name, row in r["rows"].items():
            lines.append(f"| {label} | {name} | {row['ticks']} ({row['forward_ticks']}) | "
                         f"{row['slot_bytes'] / 2**20:.2f} MiB "
                         f"| {row['read_bytes'] / 2**20:.1f} MiB | {row['write_bytes'] / 2**20:.1f} MiB "
                         f"| {row['temp_bytes'] / 2**20:.1f} MiB |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:2] == ["stash"]:
        sys.exit(stash(sys.argv[2]))
    sys.exit({"overhead": overhead, "overhead-anatomy": refresh_anatomy, "anatomy": paper_anatomy,
              "report": report}.get((sys.argv[1:] or [""])[0], main)())
