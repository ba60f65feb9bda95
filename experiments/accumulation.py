"""Gradient accumulation without a pipeline, measured: the data-parallel bytes one compiled train step moves,
its CPU step time, and the two ways of reducing once per step (a scan inside a shard_map over `data`, or
the pipeline executor run with p = 1).

    python experiments/accumulation.py traffic [DIR]  # per-step collectives over `data` from the compiled HLO
    python experiments/accumulation.py hlo DIR    # write the compiled steps' HLO to DIR (works in an old checkout)
    python experiments/accumulation.py time       # CPU seconds per train step (tiny, data=2 × tensor=4 + SP, m=4)
    python experiments/accumulation.py variants   # scan in shard_map vs the executor at p = 1 (loss + grads)

Each prints one JSON object and measures whatever `jaxseq` is importable from the current directory. The
"before" figures of experiments/results/accumulation.md: `hlo DIR` and `time` run in a checkout of the
old code (14ed963), then `traffic DIR` here reads that program with today's HLO reader.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jaxseq.config import OptimizerConfig, ParallelConfig, replace  # noqa: E402
from jaxseq.presets import preset  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.parallel.layout import Layout  # noqa: E402
from jaxseq.planning import hlo, hlo_collectives, hlo_loops  # noqa: E402
from jaxseq.training import aot  # noqa: E402
from jaxseq.training import train_step as T  # noqa: E402

MICRO_BATCHES = 4


def data_traffic(text: str, data: int, tensor: int) -> dict:
    """Per-device bytes per step of the floating-point collectives whose groups span two data ranks (on a
    data × tensor mesh): buffer bytes (each collective's full buffer × its runs per step) and ring bytes
    (`search_time.ring_traffic`), by kind, and how many run inside loops."""
    from jaxseq.planning.search_time import ring_traffic

    comps, runs = hlo.parse_hlo(text), hlo_loops.runs_per_call(text)
    data_of = np.arange(data * tensor) // tensor
    out: dict = {}
    for comp, instrs in comps.items():
        for ins in instrs:
            kind = ins.opcode.removesuffix("-start")
            if kind not in ("all-reduce", "reduce-scatter", "all-gather") or comp not in runs:
                continue
            groups = hlo_collectives.replica_groups(ins.rest)
            if groups is not None and all(len({int(data_of[i]) for i in g}) == 1 for g in groups):
                continue  # inside one data rank: tensor-parallel
            size = len(groups[0]) if groups else data
            result = sum(hlo.array_bytes(dt, dims) for dt, dims in ins.arrays() if dt.startswith(("f", "bf")))
            if not result:
                continue
            buffer = result * size if kind == "reduce-scatter" else result
            row = out.setdefault(kind, {"buffer_bytes": 0, "ring_bytes": 0.0, "ops": 0, "ops_in_loops": 0})
            row["buffer_bytes"] += buffer * runs[comp]
            row["ring_bytes"] += ring_traffic(kind, buffer, size) * runs[comp]
            row["ops"] += 1
            row["ops_in_loops"] += int(runs[comp] > 1)
    return out


CASES = {"adam": False, "distributed_optimizer": True}


def compiled_steps() -> dict[str, str]:
    """The compiled HLO of gpt2-124m's train step in float32 (XLA:CPU runs bf16 collectives in f32),
    data=4 × tensor=2 + SP, 4 micro-batches of one sequence per data rank, with and without the
    distributed optimizer. Uses only what the code before the change has too, so `hlo DIR` run in an old
    checkout gives the "before" programs."""
    cfg = replace(preset("gpt2-124m"), dtype="float32")
    optimizer = T.make_optimizer(OptimizerConfig(), cfg)
    texts = {}
    for name, distributed in CASES.items():
        parallel = ParallelConfig(data=4, tensor=2, sequence_parallel=True, distributed_optimizer=distributed)
        layout = Layout(cfg, parallel, make_mesh(parallel))
        inputs = aot.abstract_step_inputs(layout, optimizer, parallel.data * MICRO_BATCHES)
        step = T.make_train_step(layout, "selective", optimizer, MICRO_BATCHES)
        texts[name] = step.lower(*inputs).compile().as_text()
    return texts


def write_hlo(directory: str) -> dict:
    os.makedirs(directory, exist_ok=True)
    for name, text in compiled_steps().items():
        with open(os.path.join(directory, f"{name}.hlo.txt"), "w") as f:
            f.write(text)
    return {"written": directory}


def traffic(directory: str | None = None) -> dict:
    """Data-parallel traffic per step of the programs in `directory` (written by `hlo`), else compiled now."""
    if directory:
        texts = {name: open(os.path.join(directory, f"{name}.hlo.txt")).read() for name in CASES}
    else:
        texts = compiled_steps()
    out = {"model": "gpt2-124m float32", "mesh": "data=4 × tensor=2 + SP", "micro_batches": MICRO_BATCHES}
    return out | {name: data_traffic(text, data=4, tensor=2) for name, text in texts.items()}


def time_steps(fn, args, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        args = fn(*args)
        jax.block_until_ready(args)
        times.append(time.perf_counter() - start)
    return times


def step_time(steps: int = 12) -> dict:
    """The tiny preset as it is (bfloat16, dropout 0.1), data=2 × tensor=4 + SP, selective, 4 micro-batches of
    8 sequences: seconds per train step after 3 warm-up steps."""
    cfg, parallel = preset("tiny"), ParallelConfig(data=2, tensor=4, sequence_parallel=True)
    layout, optimizer = Layout(cfg, parallel, make_mesh(parallel)), T.make_optimizer(OptimizerConfig(), cfg)
    state = T.init_state(jax.random.key(0), layout, optimizer)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (8 * MICRO_BATCHES, cfg.seq_len + 1), dtype=np.int32)
    batch, key = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, jax.random.key(1)
    step = T.make_train_step(layout, "selective", optimizer, MICRO_BATCHES)
    times = time_steps(lambda state: (step(state, batch, key)[0],), (state,), 3 + steps)[3:]
    return {"median_s": statistics.median(times), "min_s": min(times), "steps": times}


def variants(rounds: int = 6, calls: int = 4) -> dict:
    """Loss and gradients of the same 4 micro-batches (tiny, data=2 × tensor=4 + SP, selective) two ways: the
    scan inside a shard_map over `data` (`data_parallel.accumulate_loss_and_grad`, what the step uses) and
    the pipeline executor at p = 1 (1F1B: 2m ticks, a lax.switch and a stash slot each). Seconds per call in
    the preset's bfloat16, calls interleaved round by round; compiled temporary bytes in float32 (XLA:CPU's
    bf16 temporaries are not a GPU's)."""
    from functools import partial

    from jaxseq.models import model as M
    from jaxseq.parallel import data_parallel as DP
    from jaxseq.parallel import pipeline as PL
    from jaxseq.sharding import batch_sharding

    parallel = ParallelConfig(data=2, tensor=4, sequence_parallel=True)
    mesh = make_mesh(parallel)
    replicated, tokens_sh = NamedSharding(mesh, P()), batch_sharding(mesh)
    param_sh = jax.tree.map(lambda spec: NamedSharding(mesh, spec), M.param_specs(preset("tiny"), parallel))

    def programs(cfg):
        layout = Layout(cfg, parallel, mesh)
        scan = partial(DP.accumulate_loss_and_grad, layout=layout, remat="selective", microbatches=MICRO_BATCHES,
                       grad_specs=layout.param_specs)
        return {"scan in shard_map": jax.jit(scan, in_shardings=(param_sh, {"inputs": tokens_sh, "targets": tokens_sh},
                                                                 replicated), out_shardings=(replicated, param_sh)),
                "executor, p = 1": PL.make_loss_and_grad(layout, "selective", MICRO_BATCHES)}

    out = {"temp_bytes_float32": {}, "seconds_bfloat16": {}}
    f32 = replace(preset("tiny"), dtype="float32")
    params, batch = aot.abstract_inputs(Layout(f32, parallel, mesh), 8 * MICRO_BATCHES)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated)
    for name, fn in programs(f32).items():
        out["temp_bytes_float32"][name] = fn.lower(params, batch, key).compile().memory_analysis().temp_size_in_bytes
    cfg = preset("tiny")
    values = jax.device_put(M.init_params(jax.random.key(0), cfg, parallel.tensor), param_sh)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (8 * MICRO_BATCHES, cfg.seq_len + 1), dtype=np.int32)
    inputs = (values, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, jax.random.key(1))
    fns = programs(cfg)
    for fn in fns.values():
        jax.block_until_ready(fn(*inputs))  # compile and warm up
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(calls):
                start = time.perf_counter()
                jax.block_until_ready(fn(*inputs))
                samples[name].append(time.perf_counter() - start)
    out["seconds_bfloat16"] = {name: {"median_s": statistics.median(t), "min_s": min(t)} for name, t in samples.items()}
    return out


if __name__ == "__main__":
    what, *args = sys.argv[1:] or ["traffic"]
    result = {"hlo": write_hlo, "traffic": traffic, "time": step_time, "variants": variants}[what](*args)
    print(json.dumps(result, indent=1))
