"""Pipeline schedules on 8 simulated CPU devices: idle ticks, in-flight activation bytes and per-device
memory of the compiled program vs the number of micro-batches m, and CPU step time next to pipe=1.

    python experiments/pipeline.py        # writes experiments/results/pipeline.{json,txt,png} (~15 min on 2 cores)

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

    from jaxseq import aot
    from jaxseq import pipeline as PL
    from jaxseq import train_step as T
    from jaxseq.config import ParallelConfig, preset, replace
    from jaxseq.mesh import make_mesh

    cfg = replace(preset("tiny"), layers=8, dtype="float32")  # h=64, s=64, a=8, V=256
    remat = "selective"
    devices = jax.devices()
    rows = []
    for name, v in SCHEDULES:
        for m in MS:
            parallel = ParallelConfig(2, 1, False, pipe=P, schedule=name, virtual_stages=v)
            mesh = make_mesh(parallel, devices)
            sched = PL.schedule_of(parallel, m, cfg.layers)
            params, batch = aot.abstract_inputs(cfg, parallel, mesh, MICRO * m)
            key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, PS()))
            start = time.perf_counter()
            compiled = PL.make_loss_and_grad(cfg, parallel, remat, mesh, m).lower(params, batch, key).compile()
            compile_s = time.perf_counter() - start
            mem = compiled.memory_analysis()
            stash, _ = PL.stash_layout(cfg, parallel, remat, mesh, m, MICRO)
            # Per device: the stash leaves are global over `data` (batch axis 2 of [k, b, s, …]).
            slot = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in stash) // parallel.data
            rows.append({
                "schedule": sched.name, "p": P, "v": v, "m": m, "ticks": sched.ticks, "idle_ticks": sched.idle_ticks,
                "bubble": sched.bubble, "paper_bubble": sched.paper_bubble, "stage0_chunks_in_flight": sched.in_flight(0),
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
    for label, parallel in [("pipe=1 data=2 tensor=4 (accumulation)", ParallelConfig(2, 4, False)),
                            *[(f"pipe={P} data=2 {n} v={v}", ParallelConfig(2, 1, False, pipe=P, schedule=n,
                                                                              virtual_stages=v))
                              for n, v in SCHEDULES]]:
        mesh = make_mesh(parallel, devices)
        opt = optax.sgd(0.0)
        state = T.init_state(jax.random.key(0), cfg, parallel, opt, mesh)
        step = T.make_train_step(cfg, parallel, remat, opt, mesh, micro_batches=m, donate=False)
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


def _dims_bytes(shape: str) -> int:
    from jaxseq import hlo

    return sum(hlo.array_bytes(dt, dims) for dt, dims in hlo.Instr("", shape, "", "").arrays())


def dot_flops(comps, comp: str, memo=None) -> float:
    """FLOPs of the dots `comp` runs (2 × output elements × contracted size), following fusions and calls,
    a `while` × its known trip count, a `conditional` at its most expensive branch. Dots are the matmuls:
    the FLOPs that matter on a GPU (elementwise work is not counted)."""
    import re

    import numpy as np

    from jaxseq import hlo

    memo = {} if memo is None else memo
    if comp in memo:
        return memo[comp]
    shapes = {ins.name: ins.shape for ins in comps[comp]}
    total = 0.0
    for ins in comps[comp]:
        if ins.opcode == "dot":
            (_, out), = ins.arrays()
            lhs = hlo.Instr("", shapes[ins.operands()[0]], "", "").arrays()[0][1]
            contracting = [int(i) for i in re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.rest).group(1).split(",") if i]
            total += 2.0 * float(np.prod(out)) * float(np.prod([lhs[i] for i in contracting]))
        elif ins.opcode in ("fusion", "call"):
            total += dot_flops(comps, ins.attr("calls") or ins.attr("to_apply"), memo)
        elif ins.opcode == "while":
            n = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.rest)
            total += int(n.group(1)) * dot_flops(comps, ins.attr("body"), memo) if n else float("nan")
        elif ins.opcode == "conditional":
            total += max(dot_flops(comps, b, memo) for b in _branches(ins))
    memo[comp] = total
    return total


def _branches(ins) -> list[str]:
    import re

    return re.findall(r"%([\w.\-]+)", re.search(r"branch_computations=\{([^}]*)\}", ins.rest).group(1))


def tick_loop_anatomy(text: str, ticks: int) -> dict:
    """What one tick runs outside its lax.switch, read from the compiled tick loop's body: bytes written per
    tick by kind (ppermute sends, stash/receive-buffer slot writes, slot reads, gradient accumulation), and
    the dot FLOPs of each switch branch."""
    import re

    from jaxseq import hlo

    comps = hlo.parse_hlo(text)
    loop, = [ins for instrs in comps.values() for ins in instrs if ins.opcode == "while"
             and re.search(r'"known_trip_count":\{"n":"' + str(ticks) + r'"\}', ins.rest)]
    body = loop.attr("body")
    out = {"ppermute": 0, "slot_writes": 0, "slot_reads": 0, "grad_accumulation": 0, "other": 0}
    counts = dict.fromkeys(out, 0)
    branches = None
    for ins in comps[body]:
        if ins.opcode == "conditional":
            memo = {}
            branches = [dot_flops(comps, b, memo) for b in _branches(ins)]
            continue
        if ins.opcode in ("get-tuple-element", "constant", "tuple", "parameter", "copy", "bitcast"):
            continue
        kind, nbytes = "other", _dims_bytes(ins.shape)
        if ins.opcode == "collective-permute":
            kind = "ppermute"
        elif ins.opcode == "fusion":
            fused = comps[ins.attr("calls")]
            ops = {i.opcode for i in fused}
            root = fused[-1]
            if root.opcode == "dynamic-update-slice":
                update = {i.name: i.shape for i in fused}[root.operands()[1]]
                kind, nbytes = "slot_writes", _dims_bytes(update)
            elif "dynamic-slice" in ops and not ins.shape.startswith(("s32", "pred")):
                kind = "slot_reads"
            elif ins.shape.startswith("f") and ops & {"add"}:
                kind = "grad_accumulation"
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

    from jaxseq import aot
    from jaxseq import hlo
    from jaxseq import pipeline as PL
    from jaxseq import train_step as T
    from jaxseq.config import ParallelConfig, preset, replace
    from jaxseq.mesh import make_mesh

    devices, m, remat = jax.devices(), OVERHEAD_M, "selective"
    results = {"micro_batch": MICRO, "microbatches": m, "remat": remat, "sizes": {},
               "load_average_start": os.getloadavg(),
               "units": "FLOPs per data rank (sum over stages) per step; bytes per device per tick; CPU seconds "
                        "per step (process time, all threads; 8 simulated devices on 2 shared cores)"}
    for size, overrides in OVERHEAD_SIZES.items():
        cfg = replace(preset("tiny"), layers=8, dtype="float32", **overrides)
        plain = ParallelConfig(2, 1, False)
        unpiped = aot.compile_loss_and_grad(cfg, plain, remat, make_mesh(plain, devices[:2]), MICRO)
        one_mb = dot_flops(hlo.parse_hlo(unpiped.as_text()), _entry(unpiped.as_text()))
        rows = []
        configs = [("pipe=1 data=2 (2 devices)", plain, devices[:2]),
                   ("pipe=1 data=2 tensor=4", ParallelConfig(2, 4, False), devices)]
        configs += [(f"pipe={P} data=2 {n} v={v}", ParallelConfig(2, 1, False, pipe=P, schedule=n, virtual_stages=v),
                     devices) for n, v in SCHEDULES]
        tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (MICRO * m, cfg.seq_len + 1), dtype=np.int32)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        for label, parallel, devs in configs:
            mesh = make_mesh(parallel, devs)
            row = {"config": label}
            if parallel.pipe > 1:
                sched = PL.schedule_of(parallel, m, cfg.layers)
                params, abstract_batch = aot.abstract_inputs(cfg, parallel, mesh, MICRO * m)
                key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, PS()))
                compiled = PL.make_loss_and_grad(cfg, parallel, remat, mesh, m).lower(params, abstract_batch, key).compile()
                text = compiled.as_text()
                anatomy = tick_loop_anatomy(text, sched.ticks)
                branch = anatomy["branch_dot_flops"]
                table = PL.tick_rows(sched)[:, :, 0]  # [ticks, p]: the branch each stage takes
                per_stage = [float(sum(branch[b] for b in table[:, s])) for s in range(sched.p)]
                comps = hlo.parse_hlo(text)
                everything = dot_flops(comps, _entry(text))  # the tick loop at its dearest branch × ticks
                loop_max = sched.ticks * max(branch)
                outside = everything - loop_max
                cost = compiled.cost_analysis()
                cost = cost[0] if isinstance(cost, (list, tuple)) else cost
                row.update({
                    "ticks": sched.ticks, "idle_ticks_per_stage": sched.idle_ticks, "busy_ticks_per_stage": sched.busy_ticks,
                    "branch_dot_flops": dict(zip(("idle", "forward", "forward_first", "forward_last", "backward",
                                                  "backward_first"), branch)),
                    "executed_dot_flops_per_stage": per_stage,
                    "outside_loop_dot_flops_per_device": outside,
                    "executed_dot_flops": sum(per_stage) + sched.p * outside,
                    "unpipelined_dot_flops": m * one_mb,
                    "cost_analysis_flops": float(cost["flops"]),
                    **anatomy,
                })
                row["flop_overhead_pct"] = 100 * (row["executed_dot_flops"] / row["unpipelined_dot_flops"] - 1)
            # CPU time of the train step on the real batch (sgd(0): the optimizer is the same for every row).
            opt = optax.sgd(0.0)
            state = T.init_state(jax.random.key(0), cfg, parallel, opt, mesh)
            step = T.make_train_step(cfg, parallel, remat, opt, mesh, micro_batches=m, donate=False)
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


def _entry(text: str) -> str:
    from jaxseq import hlo

    line = next(line for line in text.splitlines() if line.startswith("ENTRY"))
    return line.split()[1].lstrip("%")


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
            lines.append(f"| {row['config']} | {row.get('ticks', '-')} | {row.get('idle_ticks_per_stage', '-')} | {flops} "
                         f"| {row['cpu_s']:.3f} | {row['cpu_over_unpipelined']:.2f} | "
                         + (f"{1e3 * row['extra_cpu_s_per_tick']:.2f}" if "ticks" in row else "-")
                         + f" | {row['wall_s']:.3f} | {row['loss']:.6f} |")
        lines += ["", "What one tick does outside its switch branch (per device, from the compiled tick loop):", "",
                  "| config | ppermute sends | stash/receive slot writes | slot reads | gradient accumulation "
                  "| forward branch dot FLOPs | backward branch dot FLOPs |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for row in s["rows"]:
            if "ticks" not in row:
                continue
            b, n, br = row["bytes_per_tick"], row["ops_per_tick"], row["branch_dot_flops"]
            lines.append(f"| {row['config']} | {n['ppermute']} × = {b['ppermute'] / 1024:.1f} KiB | "
                         f"{n['slot_writes']} = {b['slot_writes'] / 1024:.1f} KiB | {n['slot_reads']} = "
                         f"{b['slot_reads'] / 1024:.1f} KiB | {n['grad_accumulation']} = "
                         f"{b['grad_accumulation'] / 1024:.1f} KiB | {br['forward'] / 1e6:.2f} M | "
                         f"{br['backward'] / 1e6:.2f} M |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(overhead() if sys.argv[1:] == ["overhead"] else main())
