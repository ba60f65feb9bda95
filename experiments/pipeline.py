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


if __name__ == "__main__":
    sys.exit(main())
