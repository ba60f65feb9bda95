"""One command that validates jaxseq on a GPU host, and records whether it works and how fast.

    python experiments/gpu.py               # every local GPU: writes experiments/results/gpu_<device>_<date>.{json,md}
    python experiments/gpu.py --out DIR     # … into DIR (a CPU dry run writes only when given --out)
    python experiments/gpu.py --steps 20    # more timed steps per configuration
    python experiments/gpu.py --policies lean full --budget-minutes 5    # fewer rows (`none` always), less time

On the local GPUs (tensor = their count, + sequence parallelism when > 1; bf16; `attention=fused`), for
GPT-3 XL (gpt3-1.3b) and a Llama of similar size (`models` below), per remat policy (none, selective, lean,
full): the median step time, tokens/s, model TFLOP/s per device and MFU against the device's dense bf16 peak
(jaxseq/hardware.py), each policy's step time relative to `none` (the paper's Table 4, measured), and the
peak device memory (`memory_stats()["peak_bytes_in_use"]`) beside `jaxseq.plan`'s prediction of the same
configuration (its programs compiled on these GPUs) and beside `plan --target`'s (the whole step compiled for the
GPU's target description, as on a machine without one: experiments/gpu_target.py compares it offline), and where
each step's time goes on the first device (a trace of 2 more steps: matmuls, cuDNN attention, collectives, the
other fusions, busy and idle; `device_time`); and for
`none` and `full`, the largest micro-batch `plan --target` says fits, run and measured (recompute buys batch).
Then: whether the compiled step calls cuDNN's fused attention (a `__cudnn$fmha…` custom call
in its optimized HLO); bf16 against float32 losses over the same steps on the default corpus (real text; same init
and data; float32 takes XLA's attention, cuDNN's has none in float32); the first model under `lean` at sequence
lengths 1024, 4096 and 8192 (the micro-batch's tokens held), each measured peak beside `plan --target`'s; and with
two GPUs or more context = 2 × tensor = n/2 with each strategy (ring, all-gather), the same beside the plan, and a
pipelined configuration (pipe = 2) at two micro-batch counts, whose measured bubble is set beside the schedule's
(parallel/schedule.py); and host offload: the first model under `lean` with everything it stores in host memory
(`--offload all`) and with the optimizer state there (`--offload-optimizer`), each step and peak beside the step
without and beside plan --target's device peak and host bytes, and the copy bandwidth to pinned host memory and back
beside the hardware table's PCIe figure (`offload_check`).

The models' rows always run; the sweep, the context and the pipeline configurations start only while the run's
budget (`--budget-minutes`, 8 on a GPU) leaves time for one more, and the rest say they were skipped.

Each configuration is compiled once and runs a few steps. With --out (or on a GPU) each model's results are written
as they come, marked "partial" until the run ends: a session cut off still leaves what it measured. On a GPU each
runs in its own child process, so that the peak memory it reports is its own (the backend's peak counter never
resets); the parent only plans.

On a machine without a GPU the same code runs a tiny dry version (tiny presets, 2 simulated CPU devices,
explicit attention since cuDNN is absent, few steps) so that it cannot rot; nothing it times says anything
about a GPU, and it writes nothing unless given --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
POLICIES = ("none", "selective", "lean", "full")
PARITY_TOLERANCE = 0.02  # |loss_bf16 − loss_f32| / loss_f32 per step: bf16 rounds to 2⁻⁸ ≈ 0.4% per op
PARENT_ONLY_PREALLOCATE = "JAXSEQ_GPU_CHECK_PARENT_ONLY_PREALLOCATE"  # set: the parent's "false" is not the user's
CHILD_TIMEOUT_S = 1200  # one configuration: a compile and a few steps; a hang is reported, not waited for
TOP_OPS = 12  # the ops a trace summary names, the longest first
PROFILE_STEPS = 2  # traced after each model row's timed steps: where its time goes (`device_time`)


def models(gpu: bool) -> dict:
    """name → ModelConfig. GPU: GPT-3 XL and a Llama of similar size (Llama 3.2 1B's shape, untied lm_head,
    at GPT-3 XL's sequence length); CPU: the tiny presets. Dropout 0, so that bf16 and f32 draw nothing apart."""
    from jaxseq.config import replace
    from jaxseq.presets import preset

    if not gpu:
        return {"tiny": replace(preset("tiny"), dropout=0.0), "tiny-llama": preset("tiny-llama")}
    llama_1b = replace(preset("llama3-8b"), hidden=2048, heads=32, kv_heads=8, layers=16, ffn_hidden=8192,
                       seq_len=2048)
    return {"gpt3-1.3b": replace(preset("gpt3-1.3b"), dropout=0.0), "llama-1b": llama_1b}


# ---------------------------------------------------------------------------------------------
# One configuration: compile once, run a few steps, measure


def measure(spec: dict, devices) -> dict:
    """Train `spec["steps"]` steps (after `spec["warmup"]`) of one configuration on `devices` from the same
    seed and the same batch every time: per-step wall times (each step waited for), losses, the device's peak
    memory, and the custom calls of the compiled step."""
    import jax
    import numpy as np

    from jaxseq.config import ModelConfig, OptimizerConfig, ParallelConfig
    from jaxseq.mesh import make_mesh
    from jaxseq.parallel.layout import Layout
    from jaxseq.sharding import batch_sharding
    from jaxseq.training import train_step as T

    cfg = ModelConfig(**spec["model"])
    parallel = ParallelConfig(**spec["parallel"])
    devices = list(devices)[: parallel.num_devices]
    mesh = make_mesh(parallel, devices)
    layout = Layout(cfg, parallel, mesh)
    optimizer = T.make_optimizer(OptimizerConfig(**spec.get("optimizer", {"warmup_steps": 1})), cfg)
    state = T.init_state(jax.random.key(0), layout, optimizer)
    rows = spec["micro_batch"] * spec["microbatches"]
    if spec.get("data") == "corpus":  # real text: the default corpus's first tokens (bytes), rows of s + 1
        from jaxseq.training.data import load_corpus

        text = load_corpus(None).train
        tokens = np.resize(text, rows * (cfg.seq_len + 1)).reshape(rows, cfg.seq_len + 1).astype(np.int32)
    else:
        tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (rows, cfg.seq_len + 1), dtype=np.int32)
    batch = jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, batch_sharding(mesh))
    key = jax.random.key(1)
    start = time.perf_counter()
    step = T.make_train_step(layout, spec["remat"], optimizer, spec["microbatches"],
                             offload=tuple(spec.get("offload", ())))
    autotune = autotune_path(spec) if devices[0].platform == "gpu" else None
    compiled = step.lower(state, batch, key).compile(compiler_options={AUTOTUNE_DUMP: autotune} if autotune else None)
    compile_s = time.perf_counter() - start
    times, losses = [], []
    for i in range(spec["warmup"] + spec["steps"]):
        start = time.perf_counter()
        state, out = compiled(state, batch, key)
        loss = float(jax.block_until_ready(out)["loss"])
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - start)
        losses.append(loss)
    text = compiled.as_text()
    if spec.get("hlo_path"):  # the program XLA compiled for this device, to read offline (planning/hlo*.py)
        import gzip

        with gzip.open(spec["hlo_path"], "wt") as f:
            f.write(text)
    result = {
        "step_s": times, "median_step_s": statistics.median(times), "losses": losses, "compile_s": compile_s,
        "peak_bytes_in_use": peak_bytes_in_use(devices),
        "custom_calls": custom_calls(text),
        "platform": devices[0].platform, "device_kind": devices[0].device_kind,
        "autotune_results": autotune if autotune and Path(autotune).exists() else None,
    }
    if spec.get("profile_steps"):  # after the peak is read: a failed trace is a finding, not a lost row
        try:
            traced = compiled if devices[0].platform != "gpu" else step.lower(state, batch, key).compile(
                compiler_options=KERNEL_BY_KERNEL)
            result["device_time"] = device_time(traced, state, batch, key, spec["profile_steps"],
                                                spec.get("top_ops", TOP_OPS))
        except Exception as e:
            result["device_time"] = {"error": f"{type(e).__name__}: {e}"}
    return result


KERNEL_NAME_KINDS = (("attention", ("fmha", "flash", "cudnn")), ("collective", ("nccl",)),
                     ("matmul", ("gemm", "cutlass", "xmma", "cublas")))  # a kernel that names no HLO op
# Lines a profiler's post-processing derives from the kernels' own (per HLO op, module, step): counted once, on the
# streams' lines, where a device plane has them too.
DERIVED_LINES = {"XLA Ops", "XLA Modules", "Steps", "Framework Ops", "Framework Name Scope", "Source code",
                 "XLA TraceMe", "Launch Stats"}


# XLA:GPU launches most of a step's kernels as a few CUDA graphs (command buffers), which a trace shows as one op
# each (2026-11-27: `command_buffer_1`, the whole step). The traced program is compiled again without them, so that
# each kernel shows as its HLO op; its step ran 1.4% slower than with them (0.1989 against 0.1962 s, gpt3-1.3b).
KERNEL_BY_KERNEL = {"xla_gpu_enable_command_buffer": ""}

# Which GEMMs the device's autotuner gives to cuBLAS and which to Triton (and its tiles) decides a step's peak
# (2026-11-27: up to 14%); without a device XLA cannot choose, so `plan --target` takes the larger of its all-Triton
# and all-cuBLAS programs (gpu_target.GEMMS), 5.9% above the H100's peak for unrolled layers under `full`. Each
# configuration a GPU runs writes its autotuner's choices (XLA's AutotuneResults, text), so that the same step can be
# compiled offline with the device's own choices (`xla_gpu_load_autotune_results_from`).
AUTOTUNE_DUMP = "xla_gpu_dump_autotune_results_to"


def autotune_path(spec: dict) -> str | None:
    """Where a configuration's autotuner choices go (`spec["autotune_dir"]`, on a GPU): named by its shape and a
    hash of its spec, so that no two configurations share a file."""
    if not spec.get("autotune_dir"):
        return None
    cfg = spec["model"]
    key = {k: v for k, v in spec.items() if k not in ("steps", "warmup", "profile_steps", *SPEC_PATHS)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:8]
    name = (f"{cfg['family']}_h{cfg['hidden']}_L{cfg['layers']}_s{cfg['seq_len']}_{spec['remat']}_"
            f"b{spec['micro_batch']}x{spec['microbatches']}_{cfg['layer_loop']}_{digest}.textproto")
    return str(Path(spec["autotune_dir"]) / name)


def device_time(compiled, state, batch, key, steps: int, top: int = TOP_OPS) -> dict:
    """Where a step's time goes on the first device: a `jax.profiler` trace of `steps` more steps (`trace_summary`)
    of `compiled` (on a GPU the step compiled with `KERNEL_BY_KERNEL`)."""
    import glob
    import tempfile

    import jax

    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory):
            start = time.perf_counter()
            for _ in range(steps):
                state, out = compiled(state, batch, key)
            jax.block_until_ready(out)
            wall = time.perf_counter() - start
        data = jax.profiler.ProfileData.from_file(glob.glob(directory + "/**/*.xplane.pb", recursive=True)[0])
    return trace_summary(data, compiled.as_text(), steps, wall, top)


def trace_summary(data, hlo_text: str, steps: int, wall_s: float, top_count: int = TOP_OPS) -> dict:
    """A trace's ops of the first device, in ms per step: by what each does (`hlo_kernels.op_kinds`: matmul, cuDNN
    attention, collective, convert, copy/transpose, other; a kernel that names no HLO op by its own name), the
    time the device was busy (their intervals merged over its streams) and the wall time. On a GPU the device's
    own plane; on CPU (the dry run) the host threads' ops of device 0, whose busy time says nothing of a GPU."""
    from jaxseq.planning import hlo_kernels

    module = re.match(r"HloModule (\S+?),", hlo_text).group(1)
    kinds = hlo_kernels.op_kinds(hlo_text)
    gpu = data.find_plane_with_name("/device:GPU:0")
    plane = gpu if gpu is not None else data.find_plane_with_name("/host:CPU")
    ms, top, intervals = {}, {}, []
    for line in (l for l in plane.lines if l.name not in DERIVED_LINES):
        for e in line.events:
            stats = dict(e.stats)
            other_program = not str(stats.get("hlo_module", module)).startswith(module)
            if other_program or (gpu is None and stats.get("device_ordinal") != 0):
                continue
            op = stats.get("hlo_op") or (e.name if gpu is not None else None)  # a CPU's other events are Python's
            kind = _kind(kinds, op, e.name) if op is not None else None
            if kind is None:  # a container (while, conditional): its ops are counted themselves
                continue
            ms[kind] = ms.get(kind, 0.0) + e.duration_ns / 1e6 / steps
            top[op] = top.get(op, 0.0) + e.duration_ns / 1e6 / steps
            intervals.append((e.start_ns, e.start_ns + e.duration_ns))
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):  # the union of the ops' intervals
        busy, end = busy + max(0.0, b - max(a, end)), max(end, b)
    return {"source": f"jax.profiler trace of {steps} steps, {plane.name}", "wall_ms_per_step": 1e3 * wall_s / steps,
            "busy_ms_per_step": busy / 1e6 / steps,
            "ms_per_step_by_kind": dict(sorted(ms.items(), key=lambda x: -x[1])),
            "top_ops_ms_per_step": dict(sorted(top.items(), key=lambda x: -x[1])[:top_count]),
            "lines": {line.name: sum(1 for _ in line.events) for line in plane.lines}}


def _kind(kinds: dict, op: str, kernel: str) -> str | None:
    """An op's kind (`hlo_kernels.op_kinds`); a kernel that names no HLO op of the program, by its own name."""
    if op in kinds:
        return kinds[op]
    return next((kind for kind, words in KERNEL_NAME_KINDS if any(w in kernel.lower() for w in words)), "other")


def peak_bytes_in_use(devices) -> int | None:
    """The largest of the devices' peak bytes in use since the process started (None where the backend keeps
    no count: CPU)."""
    stats = [d.memory_stats() for d in devices if hasattr(d, "memory_stats")]
    peaks = [s["peak_bytes_in_use"] for s in stats if s and "peak_bytes_in_use" in s]
    return max(peaks) if peaks else None


def custom_calls(hlo_text: str) -> dict:
    """custom-call target → how many times the optimized HLO names it (cuBLAS GEMMs, cuDNN attention, …)."""
    counts: dict = {}
    for target in re.findall(r'custom_call_target="([^"]+)"', hlo_text):
        counts[target] = counts.get(target, 0) + 1
    return dict(sorted(counts.items()))


def local_devices() -> tuple[bool, list]:
    """(whether they are GPUs, the devices to use): the local GPUs, or else 2 simulated CPU devices."""
    import jax

    gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
    return (True, gpus) if gpus else (False, jax.local_devices(backend="cpu")[:2])


def run_spec(spec: dict, devices, isolate: bool) -> dict:
    """`measure(spec)` here, or in a child process of its own (isolate) so that its peak memory is its own; the
    result appended to `spec["runs_log"]` as it comes (`record_run`)."""
    result = measure(spec, devices) if not isolate else run_child(spec)
    record_run(spec, result)
    return result


# Paths a spec carries beside the configuration: where its files go, not what it runs.
SPEC_PATHS = ("hlo_path", "autotune_dir", "runs_log")


def record_run(spec: dict, result: dict) -> None:
    """One line of JSON per configuration run (its spec and result) appended to `spec["runs_log"]`, if set: a run
    cut off anywhere still leaves every configuration it measured (2026-11-27: an H200 run cut off in its largest
    micro-batch left nothing; the tables are written only at the end of each section)."""
    if spec.get("runs_log"):
        line = {"spec": {k: v for k, v in spec.items() if k not in SPEC_PATHS}, "result": result}
        with open(spec["runs_log"], "a") as f:
            f.write(json.dumps(line) + "\n")


def run_child(spec: dict) -> dict:
    """`measure(spec)` in a child process of its own, which allocates as a training run does."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if PARENT_ONLY_PREALLOCATE in env:  # the child allocates as a training run does: one pool, taken at start
        del env["XLA_PYTHON_CLIENT_PREALLOCATE"]
    if spec.get("xla_flags"):
        env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"), spec["xla_flags"]]))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"child ran past {CHILD_TIMEOUT_S} s"}
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"error": f"child exited {proc.returncode}: " + " | ".join(tail)}
    return json.loads(line[len("RESULT "):])


# ---------------------------------------------------------------------------------------------
# The plan's prediction of each configuration's peak (the planning library, not its command)


def predicted_peaks(cfg, tensor: int, sequence_parallel: bool, micro_batch: int, devices, policies=POLICIES) -> dict:
    """policy → `jaxseq.plan`'s predicted peak bytes per device (the state's share of the peak, `State.at_peak`, +
    stored activations + the step's working memory) for `cfg` at `tensor`, one micro-batch; its rows compiled as
    `plan.plan` compiles them."""
    from jaxseq.planning.measure import Compiler, RowSpec
    from jaxseq.planning.memory import state_bytes
    from jaxseq.planning.plan import make_row

    specs = [RowSpec(p, p, sequence_parallel, tensor, None) for p in policies]
    compiler = Compiler(cfg, micro_batch, devices)
    compiler.compile_all([k for c in specs for k in compiler.programs(c)])
    measured = {c.remat: compiler.measure(c) for c in specs}
    state = state_bytes(cfg, tensor)
    rows = {p: make_row(cfg, c, measured[p], micro_batch, cfg.layers, measured["none"].flops_per_layer, state)
            for p, c in zip(policies, specs)}
    return {p: {"total_bytes": r.total_bytes_per_device, "state_bytes": state.at_peak,
                "activation_bytes": r.activation_bytes_per_device, "working_bytes": r.working_bytes_per_device}
            for p, r in rows.items()}


def target_peaks(cfg, tensor: int, sequence_parallel: bool, micro_batch: int, device_kind: str,
                 policies=POLICIES) -> dict:
    """policy → `plan --target`'s peak bytes per device (the whole train step compiled for this GPU's target
    description, as on a machine without one), or {} where the device has no target description."""
    from jaxseq.config import ParallelConfig
    from jaxseq.planning import gpu_target

    target = gpu_target.target_of(device_kind)
    if target is None:
        return {}
    parallel = ParallelConfig(tensor=tensor, sequence_parallel=sequence_parallel)
    return {p: gpu_target.step_bytes(cfg, parallel, p, micro_batch, 1, target) for p in policies}


LARGEST_MICRO_BATCH_POLICIES = ("none", "full")  # the two ends of the trade: what recompute buys in batch
MAX_MICRO_BATCH = 64


def largest_micro_batch(cfg, tensor: int, sequence_parallel: bool, policy: str, limit: int | None,
                        device_kind: str, start: int) -> tuple[int, int] | None:
    """(the largest micro-batch, doubling from `start`, whose train step compiled for this GPU's target description
    fits `limit` bytes per device; its planned bytes), or None where there is no target or no limit."""
    from jaxseq.config import ParallelConfig
    from jaxseq.planning import gpu_target

    target = gpu_target.target_of(device_kind)
    if target is None or limit is None:
        return None
    parallel, best, b = ParallelConfig(tensor=tensor, sequence_parallel=sequence_parallel), None, start
    while b <= MAX_MICRO_BATCH:
        planned = gpu_target.step_bytes(cfg, parallel, policy, b, 1, target)
        if planned > limit:
            break
        best, b = (b, planned), 2 * b
    return best


def batch_bought(cfg, n: int, sp: bool, limit, devices, base_spec: dict, parallel: dict, isolate: bool,
                 peak: float | None, deadline: float | None = None) -> dict:
    """Per end of the trade (`LARGEST_MICRO_BATCH_POLICIES`): the largest micro-batch `plan --target` says fits, run
    and measured (step time, tokens/s, peak memory): the paper's point, recompute buys batch."""
    from jaxseq.training.metrics import throughput

    out = {}
    for policy in LARGEST_MICRO_BATCH_POLICIES:
        if not in_budget(deadline):
            out[policy] = {"skipped": BUDGET_SKIP}
            continue
        try:
            found = largest_micro_batch(cfg, n, sp, policy, limit, devices[0].device_kind, base_spec["micro_batch"])
        except Exception as e:  # a finding
            out[policy] = {"error": f"{type(e).__name__}: {e}"}
            continue
        if found is None:
            out[policy] = {"skipped": "no GPU target description or memory limit for this device"}
            continue
        b, planned = found
        print(f"  {policy} at its largest micro-batch, {b} …", flush=True)
        row = {"micro_batch": b, "target_peak_bytes": planned,
               **run_spec({**base_spec, "micro_batch": b, "model": dataclasses.asdict(cfg), "parallel": parallel,
                           "remat": policy}, devices, isolate)}
        if "median_step_s" in row:
            row.update(throughput(cfg, policy, b, 1, row["median_step_s"], n, peak))
        out[policy] = row
    return out


# ---------------------------------------------------------------------------------------------
# The whole check


def check(gpu: bool, devices, steps: int, warmup: int, micro_batches: tuple, isolate: bool, names=None,
          peak_tflops_per_device: float | None = None, save=None, deadline: float | None = None,
          policies: tuple = POLICIES, autotune_dir: Path | None = None, runs_log: Path | None = None) -> dict:
    """Every configuration on `devices` (the local GPUs, or on CPU 2 simulated devices): the result as one dict.
    Each model's micro-batch is the first of `micro_batches` at which the plan predicts `none` to fit. The models'
    rows always run; the sequence sweep, the context and the pipeline checks only while `deadline`
    (time.monotonic()) leaves time for another configuration, and so do the largest micro-batches and the parity.
    On a GPU each configuration's autotuner choices are written under `autotune_dir` (`autotune_path`); every
    configuration's result is appended to `runs_log` as it comes (`record_run`)."""
    from jaxseq.config import ConfigError, ParallelConfig, on_platform, replace, validate
    from jaxseq.models.model import num_params as model_parameters
    from jaxseq.parallel.schedule import Schedule
    from jaxseq.training import aot
    from jaxseq.training.metrics import peak_tflops, throughput

    n = len(devices)
    platform = devices[0].platform
    peak = peak_tflops_per_device or peak_tflops(devices[0])
    limit = aot.device_bytes(devices[:1]) if gpu else None
    attention = "fused" if gpu else "explicit"
    sp = n > 1
    out = {
        "command": " ".join(["python", "experiments/gpu.py", *sys.argv[1:]]) if __name__ == "__main__" else None,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dry_run": not gpu, "platform": platform, "device_kind": devices[0].device_kind, "devices": n,
        "peak_tflops_per_device": peak,
        "peak_source": "--peak-tflops" if peak_tflops_per_device else "jaxseq/hardware.py by device kind",
        "device_bytes_limit": limit, "attention": attention,
        "attention_note": ("fused (jax.nn.dot_product_attention)" if gpu else
                           "explicit: a CPU dry run, cuDNN is absent; its times say nothing about a GPU"),
        "mesh": f"tensor={n}" + (" + SP" if sp else ""), "steps": steps, "warmup_steps": warmup,
        "micro_batch_candidates": list(micro_batches), "parity_tolerance": PARITY_TOLERANCE,
        "units": "seconds (step_s, median_step_s), tokens/s, TFLOP/s per device (model FLOPs, the paper's "
                 "formula ÷ measured time), MFU = model TFLOP/s ÷ peak_tflops_per_device, bytes (memory)",
        "jax_version": __import__("jax").__version__,
        "models": {},
    }
    cfgs = {k: v for k, v in models(gpu).items() if names is None or k in names}
    for name, cfg in cfgs.items():
        cfg = on_platform(replace(cfg, dtype="bfloat16", attention=attention), platform)
        try:
            validate(cfg, ParallelConfig(tensor=n, sequence_parallel=sp), "none")
        except ConfigError as e:  # e.g. 3 GPUs: tensor=3 divides no Llama head count
            out["models"][name] = {"skipped": str(e), "config": dataclasses.asdict(cfg)}
            continue
        parallel = {"tensor": n, "sequence_parallel": sp}
        for micro_batch in micro_batches:
            print(f"{name}: planning tensor={n}, micro-batch {micro_batch} …", flush=True)
            try:
                plan, plan_error = predicted_peaks(cfg, n, sp, micro_batch, devices, policies), None
            except Exception as e:  # the measurements still run; the failure is a finding
                plan, plan_error = None, f"{type(e).__name__}: {e}"
                break
            if limit is None or plan["none"]["total_bytes"] <= limit:
                break
        base_spec = {"micro_batch": micro_batch, "microbatches": 1, "steps": steps, "warmup": warmup,
                     "autotune_dir": autotune_dir and str(autotune_dir), "runs_log": runs_log and str(runs_log)}
        try:
            targeted, target_error = (target_peaks(cfg, n, sp, micro_batch, devices[0].device_kind, policies)
                                      if gpu else {}), None
        except Exception as e:  # a finding, as the plan's
            targeted, target_error = {}, f"{type(e).__name__}: {e}"
        result = {"config": dataclasses.asdict(cfg), "num_params": model_parameters(cfg), "micro_batch": micro_batch,
                  "plan_error": plan_error, "target_error": target_error, "policies": {}}
        for policy in policies:
            predicted = plan[policy]["total_bytes"] if plan else None
            row = {"predicted_peak_bytes": predicted, "plan": plan and plan[policy],
                   "target_peak_bytes": targeted.get(policy)}
            if limit is not None and predicted is not None and predicted > limit:
                row["skipped"] = f"the plan predicts {predicted / 2**30:.1f} GiB > {limit / 2**30:.1f} GiB per device"
            else:
                print(f"{name}: {policy} …", flush=True)
                spec = {**base_spec, "model": dataclasses.asdict(cfg), "parallel": parallel, "remat": policy,
                        "profile_steps": PROFILE_STEPS}
                row.update(run_spec(spec, devices, isolate))
                if "median_step_s" in row:
                    row.update(throughput(cfg, policy, micro_batch, 1, row["median_step_s"], n, peak))
                    measured = row["peak_bytes_in_use"]
                    row["measured_over_predicted_peak"] = measured / predicted if measured and predicted else None
                    target = row["target_peak_bytes"]
                    row["measured_over_target_peak"] = measured / target if measured and target else None
            result["policies"][policy] = row
        base = result["policies"]["none"].get("median_step_s")
        for row in result["policies"].values():
            row["step_time_vs_none"] = row["median_step_s"] / base if base and "median_step_s" in row else None
        result["cudnn_attention"] = cudnn_verdict(gpu, result["policies"])
        result["unrolled"] = unrolled_rows(gpu, cfg, policies, result["policies"], base_spec, parallel, devices,
                                           isolate, peak, deadline)
        result["largest_micro_batch"] = batch_bought(cfg, n, sp, limit, devices, base_spec, parallel, isolate, peak,
                                                     deadline)
        result["parity"] = {"ok": None, "note": "not run yet"}
        out["models"][name] = result
        if save is not None:  # what is measured so far, on disk: a run cut off here still leaves it
            save(out)
        result["parity"] = (parity(gpu, cfg, result["policies"], base_spec, parallel, devices, isolate)
                            if in_budget(deadline) else {"ok": None, "note": f"skipped: {BUDGET_SKIP}"})
        if save is not None:
            save(out)
    ran = [k for k, m in out["models"].items() if "skipped" not in m]
    if not ran:
        for section in ("sequence_sweep", "context", "pipeline", "offload"):
            out[section] = {"skipped": "no model runs on this mesh"}
        return out
    first = ran[0]
    cfg = on_platform(replace(cfgs[first], dtype="bfloat16", attention=attention), platform)
    base_spec = {"micro_batch": out["models"][first]["micro_batch"], "microbatches": 1, "steps": steps,
                 "warmup": warmup, "autotune_dir": autotune_dir and str(autotune_dir),
                 "runs_log": runs_log and str(runs_log)}
    out["sequence_sweep"] = sequence_sweep(gpu, first, cfg, devices, base_spec, {"tensor": n, "sequence_parallel": sp},
                                           isolate, peak, deadline)
    if save is not None:
        save(out)
    out["context"] = context_check(gpu, first, cfg, devices, base_spec, isolate, peak, deadline)
    if save is not None:
        save(out)
    out["pipeline"] = (pipeline_check(gpu, {k: cfgs[k] for k in ran}, devices, base_spec, attention, isolate, Schedule)
                       if in_budget(deadline) else {"skipped": BUDGET_SKIP})
    if save is not None:
        save(out)
    out["offload"] = offload_check(gpu, first, cfg, devices, base_spec, {"tensor": n, "sequence_parallel": sp},
                                   isolate, deadline)
    return out


# `none` first: a GPU run's default with fused attention and unrolled layers (config.default_remat), then `lean`, not
# yet measured unrolled, and `full`: the ends, where the scan's stacks cost most and least (scan_stacks.md)
UNROLLED_POLICIES = ("none", "lean", "full")


def unrolled_rows(gpu: bool, cfg, policies: tuple, scanned: dict, base_spec: dict, parallel: dict, devices,
                  isolate: bool, peak, deadline) -> dict:
    """`lean`, `none` and `full` again with the layers unrolled (`layer_loop="unrolled"`: no scan stacks), on a GPU
    only (XLA:CPU does not keep a remat policy for unrolled layers): each row's step time and peak against its
    scanned row's.
    experiments/scan_stacks.py predicts it from the H100's program: 12–15% faster under `none`, 3–4% under `full`;
    an H100 measured 13.9% and 4.4% (2026-11-27, results/gpu_h100_2026-11-27/)."""
    from jaxseq.config import replace
    from jaxseq.training.metrics import throughput

    if not gpu:
        return {"skipped": "a GPU only: XLA:CPU does not keep a remat policy for unrolled layers"}
    rows = {}
    for policy in (p for p in UNROLLED_POLICIES if p in policies and "median_step_s" in scanned.get(p, {})):
        if not in_budget(deadline):
            rows[policy] = {"skipped": BUDGET_SKIP}
            continue
        print(f"unrolled layers: {policy} …", flush=True)
        unrolled = replace(cfg, layer_loop="unrolled")
        row = run_spec({**base_spec, "model": dataclasses.asdict(unrolled), "parallel": parallel, "remat": policy},
                       devices, isolate)
        if "median_step_s" in row:
            row.update(throughput(unrolled, policy, base_spec["micro_batch"], 1, row["median_step_s"],
                                  len(devices), peak))
            row["step_vs_scan"] = row["median_step_s"] / scanned[policy]["median_step_s"]
            measured, scan_peak = row.get("peak_bytes_in_use"), scanned[policy].get("peak_bytes_in_use")
            row["peak_vs_scan"] = measured / scan_peak if measured and scan_peak else None
        rows[policy] = row
    return rows


def cudnn_verdict(gpu: bool, rows: dict) -> dict:
    """Whether the compiled steps call cuDNN's fused attention, from their custom calls."""
    from jaxseq.planning.hlo import CUDNN_ATTENTION

    if not gpu:
        return {"used": None, "note": "not applicable on CPU (explicit attention; cuDNN is absent)"}
    calls = {p: r.get("custom_calls") for p, r in rows.items() if r.get("custom_calls") is not None}
    used = {p: sorted(t for t in c if t.startswith(CUDNN_ATTENTION)) for p, c in calls.items()}
    ok = bool(used) and all(used.values())
    return {"used": ok, "fmha_targets": used,
            "note": f"custom calls named {CUDNN_ATTENTION}… in each policy's optimized HLO" + (
                "" if ok else "; where none: which implementation models/ops.causal_attention asks "
                              "jax.nn.dot_product_attention for (cfg.fused_kernel, set by config.on_platform)")}


def parity(gpu: bool, cfg, rows: dict, base_spec: dict, parallel: dict, devices, isolate: bool) -> dict:
    """`full` (least memory) in bf16 against float32 on real text (the default corpus: uniform random tokens teach
    nothing, so their losses barely move): same init, data and steps, under a training run's own schedule
    (OptimizerConfig's warmup). Not the timed rows' full rate from the first step: on the same batch that
    diverged (gpt3-1.3b's loss 11.2 → 18.8 in 3 steps, 2026-11-27), and a chaotic trajectory amplifies any
    rounding into a loss apart. float32 with fused attention runs XLA's kernel (cuDNN's takes no float32:
    `config.on_platform`)."""
    from jaxseq.config import on_platform

    spec = {**base_spec, "parallel": parallel, "remat": "full", "data": "corpus", "optimizer": {}}
    print("  bf16 / float32 parity runs on the default corpus …", flush=True)
    bf16 = run_spec({**spec, "model": dataclasses.asdict(cfg)}, devices, isolate)
    platform = devices[0].platform
    f32 = run_spec({**spec, "model": dataclasses.asdict(on_platform(dataclasses.replace(cfg, dtype="float32"),
                                                                    platform))}, devices, isolate)
    if "losses" not in bf16 or "losses" not in f32:
        return {"ok": None, "note": (bf16.get("error") or f32.get("error") or "a parity run failed")}
    rel = [abs(a - b) / abs(b) for a, b in zip(bf16["losses"], f32["losses"])]
    return {"ok": max(rel) <= PARITY_TOLERANCE, "tolerance": PARITY_TOLERANCE, "schedule": "OptimizerConfig()'s",
            "losses_bf16": bf16["losses"],
            "losses_f32": f32["losses"], "max_relative_difference": max(rel), "remat": "full", "data": "default corpus",
            "f32_median_step_s": f32["median_step_s"]}


SWEEP_POLICY = "lean"  # the scanned GPU default with fused attention (config.GPU_FUSED_REMAT), as earlier sweeps ran
SWEEP_SEQ_LENS = {True: (1024, 4096, 8192), False: (128,)}  # GPU, dry run: at the base model's tokens per micro-batch
RUN_ESTIMATE_S = 45  # one more configuration on a GPU: a child's start, compile (11-15 s measured) and steps
BUDGET_SKIP = "the run's time budget (--budget-minutes)"  # why a configuration past the deadline did not start


def in_budget(deadline: float | None) -> bool:
    """Whether one more configuration fits before the run's deadline (None: no deadline)."""
    return deadline is None or time.monotonic() + RUN_ESTIMATE_S <= deadline


def shape_row(cfg, parallel: dict, micro_batch: int, base_spec: dict, devices, isolate: bool, peak,
              gpu: bool) -> dict:
    """One configuration beyond the models' rows: plan --target's peak (on a GPU with a target description), then
    run and measured, with its throughput and measured / target."""
    from jaxseq.config import ParallelConfig
    from jaxseq.planning import gpu_target
    from jaxseq.training.metrics import throughput

    row = {"micro_batch": micro_batch, "seq_len": cfg.seq_len, "target_peak_bytes": None}
    target = gpu_target.target_of(devices[0].device_kind) if gpu else None
    if target is not None:
        try:
            row["target_peak_bytes"] = gpu_target.step_bytes(cfg, ParallelConfig(**parallel), SWEEP_POLICY,
                                                             micro_batch, 1, target)
        except Exception as e:  # a finding
            row["target_error"] = f"{type(e).__name__}: {e}"
    row.update(run_spec({**base_spec, "micro_batch": micro_batch, "model": dataclasses.asdict(cfg),
                         "parallel": parallel, "remat": SWEEP_POLICY}, devices, isolate))
    if "median_step_s" in row:
        n = len(devices)
        row.update(throughput(cfg, SWEEP_POLICY, micro_batch, 1, row["median_step_s"], n, peak))
        measured, target_bytes = row.get("peak_bytes_in_use"), row["target_peak_bytes"]
        row["measured_over_target_peak"] = measured / target_bytes if measured and target_bytes else None
    return row


def sequence_sweep(gpu: bool, name: str, cfg, devices, base_spec: dict, parallel: dict, isolate: bool, peak,
                   deadline) -> dict:
    """`SWEEP_POLICY` at other sequence lengths, tokens per micro-batch held (micro-batch × s): the plan against
    peaks at shapes the models' rows do not measure, and the step time as the attention's s² share grows."""
    from jaxseq.config import replace

    tokens = base_spec["micro_batch"] * cfg.seq_len
    out = {"model": name, "remat": SWEEP_POLICY, "tokens_per_micro_batch": tokens, "runs": []}
    for seq_len in SWEEP_SEQ_LENS[gpu]:
        if not in_budget(deadline):
            out["runs"].append({"seq_len": seq_len, "skipped": BUDGET_SKIP})
            continue
        print(f"sequence sweep: {name} s={seq_len} …", flush=True)
        out["runs"].append(shape_row(replace(cfg, seq_len=seq_len), parallel, max(1, tokens // seq_len), base_spec,
                                     devices, isolate, peak, gpu))
    return out


def context_check(gpu: bool, name: str, cfg, devices, base_spec: dict, isolate: bool, peak, deadline) -> dict:
    """context = 2 × tensor = n/2 (+ SP), each strategy (ring, all-gather), at the model's shape: its peak against
    plan --target and its step beside the tensor-parallel row's."""
    from jaxseq.config import ConfigError, ParallelConfig, on_platform, validate

    n = len(devices)
    if n < 2 or n % 2:
        return {"skipped": f"needs an even number of devices ≥ 2; {n} here"}
    tensor = n // 2
    out = {"model": name, "remat": SWEEP_POLICY,
           "mesh": f"context=2 × tensor={tensor}" + (" + SP" if tensor > 1 else ""), "runs": {}}
    for strategy in ("ring", "all-gather"):
        parallel = {"context": 2, "tensor": tensor, "sequence_parallel": tensor > 1, "context_strategy": strategy}
        try:
            validate(cfg, ParallelConfig(**parallel), SWEEP_POLICY)
        except ConfigError as e:
            out["runs"][strategy] = {"skipped": str(e)}
            continue
        if not in_budget(deadline):
            out["runs"][strategy] = {"skipped": BUDGET_SKIP}
            continue
        print(f"context: {name} context=2 tensor={tensor} {strategy} …", flush=True)
        run_cfg = on_platform(cfg, devices[0].platform, ParallelConfig(**parallel))  # all-gather: XLA's attention
        out["runs"][strategy] = shape_row(run_cfg, parallel, base_spec["micro_batch"], base_spec, devices, isolate,
                                          peak, gpu)
    return out


OFFLOAD_RUNS = {"without": ({}, None), "--offload all": ({}, "all"),
                "--offload-optimizer": ({"offload_optimizer": True}, None)}
COPY_BYTES = 2**30  # the array timed to host memory and back (`copy_bandwidth`)


def offload_check(gpu: bool, name: str, cfg, devices, base_spec: dict, parallel: dict, isolate: bool,
                  deadline) -> dict:
    """Host offload (train --offload all, --offload-optimizer) under `SWEEP_POLICY` at the model's shape: each run's
    step and peak beside the same step without, and beside plan --target's device peak and host bytes
    (`gpu_target.step_memory`); and the copy bandwidth to host memory and back, against the hardware table's PCIe
    figure the plan prices the copies at (jaxseq/hardware.py)."""
    from jaxseq import offload
    from jaxseq.config import ParallelConfig
    from jaxseq.models.model import tagged_names
    from jaxseq.planning import gpu_target

    names = offload.resolve("all", SWEEP_POLICY, tagged_names(cfg))
    target = gpu_target.target_of(devices[0].device_kind) if gpu else None
    out = {"model": name, "remat": SWEEP_POLICY, "offloaded": list(names), "runs": {},
           "copy": copy_bandwidth(devices[0], COPY_BYTES if gpu else 2**20)}
    for label, (extra, text) in OFFLOAD_RUNS.items():
        if not in_budget(deadline):
            out["runs"][label] = {"skipped": BUDGET_SKIP}
            continue
        print(f"offload: {name} {label} …", flush=True)
        run = {**parallel, **extra}
        chosen = names if text else ()
        row = {"target_peak_bytes": None, "target_host_bytes": None}
        if target is not None:
            try:
                row["target_peak_bytes"], row["target_host_bytes"] = gpu_target.step_memory(
                    cfg, ParallelConfig(**run), SWEEP_POLICY, base_spec["micro_batch"], 1, target, chosen)
            except Exception as e:  # a finding
                row["target_error"] = f"{type(e).__name__}: {e}"
        row.update(run_spec({**base_spec, "model": dataclasses.asdict(cfg), "parallel": run, "remat": SWEEP_POLICY,
                             "offload": list(chosen)}, devices, isolate))
        out["runs"][label] = row
    plain = out["runs"]["without"].get("median_step_s")
    for row in out["runs"].values():
        row["step_vs_without"] = row["median_step_s"] / plain if plain and "median_step_s" in row else None
    return out


def copy_bandwidth(device, nbytes: int, repeats: int = 5) -> dict:
    """GB/s of a `nbytes` float32 array copied from `device`'s memory to its pinned host memory and back (the
    median of `repeats` each way); an error is a finding (XLA:CPU may have no such memory)."""
    import jax
    import jax.numpy as jnp

    try:
        x = jax.device_put(jnp.ones(nbytes // 4, jnp.float32), device)
        host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        back = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
        times = {"to_host": [], "to_device": []}
        for _ in range(repeats):
            start = time.perf_counter()
            h = jax.block_until_ready(jax.device_put(x, host))
            times["to_host"].append(time.perf_counter() - start)
            start = time.perf_counter()
            jax.block_until_ready(jax.device_put(h, back))
            times["to_device"].append(time.perf_counter() - start)
        return {"bytes": nbytes, **{f"{k}_gb_per_s": nbytes / statistics.median(v) / 1e9 for k, v in times.items()}}
    except Exception as e:
        return {"bytes": nbytes, "error": f"{type(e).__name__}: {e}"}


def pipeline_check(gpu: bool, cfgs: dict, devices, base_spec: dict, attention: str, isolate: bool, Schedule) -> dict:
    """pipe = 2 × tensor = n/2 (+ SP) with 1F1B at m = 2 and m = 4 micro-batches of the first model. The lock-step
    executor runs `Schedule.ticks` ticks, so step(m) = fixed + ticks(m)·τ: two m give τ and the fixed part, and
    the measured bubble is (step − busy ticks·τ) / (busy ticks·τ), the schedule's own idle/busy plus whatever the
    step does outside the ticks (the optimizer update), to set beside `Schedule.bubble`. Then ZB-H1 at m = 4 (the
    backward split into B and W), its step beside 1F1B's."""
    from jaxseq.config import ParallelConfig, on_platform, replace

    n = len(devices)
    if n < 2 or n % 2:
        return {"skipped": f"needs an even number of devices ≥ 2; {n} here"}
    name, cfg = next(iter(cfgs.items()))
    tensor = n // 2
    parallel = {"pipe": 2, "tensor": tensor, "sequence_parallel": tensor > 1, "schedule": "1f1b"}
    cfg = on_platform(replace(cfg, dtype="bfloat16", attention=attention), devices[0].platform,
                      ParallelConfig(**parallel))  # cuDNN's in bf16, nested in the pipeline's region (cudnn_attention)
    runs = []
    for schedule, m in (("1f1b", 2), ("1f1b", 4), ("zb-h1", 4)):
        sched = Schedule.make(schedule, 2, m, 1, cfg.layers)
        print(f"pipeline: pipe=2 tensor={tensor} {schedule} m={m} …", flush=True)
        spec = {**base_spec, "microbatches": m, "model": dataclasses.asdict(cfg),
                "parallel": {**parallel, "schedule": schedule}, "remat": "selective"}
        row = {"schedule": schedule, "microbatches": m, "ticks": sched.ticks, "busy_ticks": sched.busy_ticks,
               "schedule_bubble": sched.bubble, "paper_bubble": sched.paper_bubble}
        row.update(run_spec(spec, devices, isolate))
        runs.append(row)
    out = {"model": name, "dtype": cfg.dtype, "micro_batch": base_spec["micro_batch"],
           "mesh": f"pipe=2 × tensor={tensor}" + (" + SP" if tensor > 1 else ""),
           "schedule": "1f1b", "remat": "selective", "runs": runs}
    if all("median_step_s" in r for r in runs[:2]):
        a, b = runs[:2]
        tick_s = (b["median_step_s"] - a["median_step_s"]) / (b["ticks"] - a["ticks"])
        out["tick_s"] = tick_s
        out["fixed_s"] = a["median_step_s"] - a["ticks"] * tick_s
        for r in runs[:2]:
            busy = r["busy_ticks"] * tick_s
            r["measured_bubble"] = (r["median_step_s"] - busy) / busy if busy > 0 else None
    if "median_step_s" in runs[1] and "median_step_s" in runs[2]:
        out["zb_h1_over_1f1b"] = runs[2]["median_step_s"] / runs[1]["median_step_s"]
    return out


# ---------------------------------------------------------------------------------------------
# Output


def table(result: dict) -> str:
    """The short Markdown table the command prints and writes."""
    pct = lambda x: "" if x is None else f"{100 * x:.1f}%"
    num = lambda x, f: "" if x is None else format(x, f)
    mib = lambda x: "" if x is None else f"{x / 2**20:.1f}"
    lines = [f"# jaxseq on {result['devices']} × {result['device_kind']} ({result['platform']}), {result['date_utc']}",
             "", f"{'DRY RUN: ' if result['dry_run'] else ''}attention {result['attention_note']}; mesh "
             f"{result['mesh']}; bf16; median of {result['steps']} steps after "
             f"{result['warmup_steps']} warm-up; peak {num(result['peak_tflops_per_device'], '.0f') or 'unknown'} "
             f"TFLOP/s per device ({result['peak_source']}).", ""]
    for name, m in result["models"].items():
        if "skipped" in m:
            lines += [f"## {name}: skipped ({m['skipped']})", ""]
            continue
        lines += [f"## {name} ({m['num_params'] / 1e6:.1f} M parameters, micro-batch {m['micro_batch']} × "
                  f"{m['config']['seq_len']} tokens)", "",
                  "| remat | step, s | vs none | tokens/s | model TFLOP/s per device | MFU | peak memory, MiB "
                  "(measured) | peak memory, MiB (plan) | measured / plan | peak memory, MiB (plan --target) | "
                  "measured / target |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for policy, r in m["policies"].items():
            if "median_step_s" not in r:
                lines.append(f"| {policy} | {r.get('skipped') or r.get('error', '')} | | | | | | "
                             f"{mib(r['predicted_peak_bytes'])} | | {mib(r.get('target_peak_bytes'))} | |")
                continue
            lines.append(f"| {policy} | {r['median_step_s']:.4f} | {num(r['step_time_vs_none'], '.3f')} | "
                         f"{r['tokens_per_sec']:.0f} | {r['tflops_per_device']:.4g} | "
                         f"{pct(r['mfu']) or 'n/a (no peak)'} | "
                         f"{mib(r['peak_bytes_in_use']) or 'n/a (no count)'} | {mib(r['predicted_peak_bytes'])} | "
                         f"{num(r['measured_over_predicted_peak'], '.3f')} | {mib(r.get('target_peak_bytes'))} | "
                         f"{num(r.get('measured_over_target_peak'), '.3f')} |")
        lines += device_time_table(m["policies"])
        unrolled = m.get("unrolled", {})
        if unrolled and "skipped" not in unrolled:
            lines += ["", "Unrolled layers (`layer_loop=unrolled`, no scan stacks) against the scanned rows above:", "",
                      "| remat | step, s | vs scan | MFU | peak memory, MiB | vs scan |",
                      "| --- | --- | --- | --- | --- | --- |"]
            for policy, r in unrolled.items():
                lines.append(f"| {policy} | " + (" | ".join([
                    f"{r['median_step_s']:.4f}", num(r["step_vs_scan"], ".3f"), pct(r["mfu"]) or "n/a",
                    mib(r.get("peak_bytes_in_use")) or "n/a", num(r.get("peak_vs_scan"), ".3f")])
                    if "median_step_s" in r else r.get("skipped") or r.get("error", "")) + " |")
        for policy, r in m.get("largest_micro_batch", {}).items():
            lines.append(f"\n{policy} at its largest micro-batch: " + (
                r.get("skipped") or r.get("error") or
                f"{r['micro_batch']} (plan --target: {mib(r['target_peak_bytes'])} MiB), {r['median_step_s']:.4f} s, "
                f"{r['tokens_per_sec']:.0f} tokens/s, MFU {pct(r['mfu']) or 'n/a'}, peak "
                f"{mib(r['peak_bytes_in_use']) or 'n/a'} MiB measured"))
        c, p = m["cudnn_attention"], m["parity"]
        lines += [f"\nthe plan failed: {m['plan_error']}"] if m["plan_error"] else []
        lines += [f"\nplan --target failed: {m['target_error']}"] if m.get("target_error") else []
        lines += ["", "cuDNN fused attention: " + (c["note"] if c["used"] is None else
                                                     f"used {c['used']} ({c['note']}; {c['fmha_targets']})"),
                  f"bf16 vs float32 losses ({p.get('remat', '')}, same init, data and schedule "
                  f"({p.get('schedule', 'warmup 1 step')}), {p.get('data', '')}): "
                  + (f"max relative difference {p['max_relative_difference']:.2e}, tolerance {p['tolerance']}: "
                     + ("within" if p["ok"] else "OUTSIDE") if p.get("ok") is not None else p["note"]), ""]
    lines += shape_table(result.get("sequence_sweep"), "Sequence lengths", "s") + shape_table(
        result.get("context"), "Context parallelism", "strategy")
    pl = result["pipeline"]
    if "skipped" in pl:
        lines += [f"## Pipeline: skipped ({pl['skipped']})"]
    else:
        lines += [f"## Pipeline: {pl['model']}, {pl['dtype']}, {pl['mesh']}, {pl['schedule']}, {pl['remat']}, "
                  f"micro-batch {pl['micro_batch']}", "",
                  "| schedule | micro-batches | ticks | step, s | bubble (measured) | bubble (schedule) | paper |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in pl["runs"]:
            lines.append(f"| {r.get('schedule', '1f1b')} | {r['microbatches']} | {r['ticks']} | "
                         f"{num(r.get('median_step_s'), '.4f') or r.get('error')} | "
                         f"{num(r.get('measured_bubble'), '.3f') or 'n/a'} | {r['schedule_bubble']:.3f} | "
                         f"{r['paper_bubble']:.3f} |")
        if "zb_h1_over_1f1b" in pl:
            lines += ["", f"ZB-H1's step over 1F1B's at m = 4: {pl['zb_h1_over_1f1b']:.3f}"]
        if "tick_s" in pl:
            lines += ["", f"tick {pl['tick_s']:.4g} s and fixed {pl['fixed_s']:.4g} s per step, fitted from the two "
                          "step times; measured bubble = (step − busy ticks × tick) / (busy ticks × tick)"
                          + ("" if pl["tick_s"] > 0 else " (n/a: the fitted tick is not positive)") + "."]
    lines += offload_table(result.get("offload"))
    return "\n".join(lines) + "\n"


def offload_table(section: dict | None) -> list[str]:
    """The offload rows: each run's step and peak against the step without and against plan --target."""
    if not section:
        return []
    if "skipped" in section:
        return ["", f"## Host offload: skipped ({section['skipped']})"]
    mib = lambda x: "" if x is None else f"{x / 2**20:.1f}"
    c = section["copy"]
    lines = ["", f"## Host offload: {section['model']}, {section['remat']} (`--offload all`: "
                 f"{', '.join(section['offloaded'])})", "",
             "copy to pinned host memory and back: " + (c.get("error") or f"{c['to_host_gb_per_s']:.1f} and "
                                                           f"{c['to_device_gb_per_s']:.1f} GB/s ({c['bytes']} bytes)"),
             "", "| run | step, s | vs without | peak memory, MiB (measured) | peak memory, MiB (plan --target) | "
                 "host memory, MiB (plan --target) |", "| --- | --- | --- | --- | --- | --- |"]
    for label, r in section["runs"].items():
        if "median_step_s" not in r:
            lines.append(f"| {label} | {r.get('skipped') or r.get('error', '')} | | | | |")
            continue
        ratio = "" if r["step_vs_without"] is None else f"{r['step_vs_without']:.3f}"
        lines.append(f"| {label} | {r['median_step_s']:.4f} | {ratio} | "
                     f"{mib(r.get('peak_bytes_in_use')) or 'n/a'} | {mib(r['target_peak_bytes'])} | "
                     f"{mib(r['target_host_bytes'])} |")
    return lines


DEVICE_TIME_KINDS = ("matmul", "attention", "collective", "other", "convert", "copy/transpose")


def device_time_table(rows: dict) -> list[str]:
    """Each policy's `device_time` as Markdown lines: ms per step by kind, busy and idle (wall − busy)."""
    timed = {p: r["device_time"] for p, r in rows.items() if "device_time" in r}
    if not timed:
        return []
    source = next((t["source"] for t in timed.values() if "source" in t), "")
    lines = ["", f"Where a step's time goes, ms per step ({source}; the trace's own overhead included; on a GPU the "
                 "step compiled without command buffers, each kernel launched on its own):", "",
             "| remat | wall | busy | idle | " + " | ".join(DEVICE_TIME_KINDS) + " |",
             "| --- " * (4 + len(DEVICE_TIME_KINDS)) + "|"]
    for policy, t in timed.items():
        if "error" in t:
            lines.append(f"| {policy} | {t['error']} |" + " |" * (2 + len(DEVICE_TIME_KINDS)))
            continue
        kinds = t["ms_per_step_by_kind"]
        lines.append(f"| {policy} | {t['wall_ms_per_step']:.2f} | {t['busy_ms_per_step']:.2f} | "
                     f"{t['wall_ms_per_step'] - t['busy_ms_per_step']:.2f} | "
                     + " | ".join(f"{kinds.get(k, 0.0):.2f}" for k in DEVICE_TIME_KINDS) + " |")
    return lines


def shape_table(section: dict | None, title: str, key: str) -> list[str]:
    """The sequence sweep's or the context check's rows (`shape_row`) as Markdown lines."""
    if section is None:
        return []
    if "skipped" in section:
        return [f"## {title}: skipped ({section['skipped']})", ""]
    runs = section["runs"]
    rows = runs.items() if isinstance(runs, dict) else ((r["seq_len"], r) for r in runs)
    mib = lambda x: "" if x is None else f"{x / 2**20:.1f}"
    mesh = section.get("mesh", "the models' mesh")
    lines = [f"## {title}: {section['model']}, {mesh}, {section['remat']}", "",
             f"| {key} | micro-batch | step, s | tokens/s | MFU | peak memory, MiB (measured) | "
             "peak memory, MiB (plan --target) | measured / target |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in rows:
        if "median_step_s" not in r:
            lines.append(f"| {name} | {r.get('micro_batch', '')} | {r.get('skipped') or r.get('error', '')} | | | | "
                         f"{mib(r.get('target_peak_bytes'))} | |")
            continue
        mfu = "" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
        ratio = "" if r.get("measured_over_target_peak") is None else f"{r['measured_over_target_peak']:.3f}"
        lines.append(f"| {name} | {r['micro_batch']} | {r['median_step_s']:.4f} | {r['tokens_per_sec']:.0f} | {mfu} | "
                     f"{mib(r['peak_bytes_in_use'])} | {mib(r['target_peak_bytes'])} | {ratio} |")
    return lines + [""]


def file_stem(device_kind: str, date_utc: str) -> str:
    """A run's files' common name: gpu_<device kind>_<date>."""
    kind = re.sub(r"[^A-Za-z0-9]+", "-", device_kind).strip("-").lower()
    return f"gpu_{kind}_{date_utc[:10]}"


def write(result: dict, out_dir: Path) -> tuple[Path, Path]:
    name = file_stem(result["device_kind"], result["date_utc"])
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / f"{name}.json", out_dir / f"{name}.md"
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    paths[1].write_text(table(result))
    return paths


def run(argv: list[str] | None = None) -> dict:
    """The command, callable in-process (the test's dry run): the result dict; files only where asked (or on
    a GPU, by default)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="directory for gpu_<device>_<date>.{json,md} (default on a GPU: experiments/results; "
                                 "a CPU dry run writes nothing without it)")
    p.add_argument("--steps", type=int, help="timed steps per configuration (default 10 on GPU, 2 dry)")
    p.add_argument("--micro-batch", type=int, help="sequences per micro-batch (default on GPU: the first of 4, 2, 1 at "
                                                   "which the plan predicts `none` to fit; dry: 2)")
    p.add_argument("--models", nargs="+", help="only these of the models (GPU: gpt3-1.3b llama-1b; dry: tiny "
                                               "tiny-llama); the pipeline runs the first")
    p.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, TFLOP/s, for MFU (default: "
                                                     "jaxseq/hardware.py's for the device kind; none for others)")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                   help="the remat policies of the models' rows (default all four; none is every row's reference and "
                        "always runs)")
    p.add_argument("--budget-minutes", type=float, help="start no sequence-sweep, context or pipeline configuration "
                                                        "past this many minutes from the start (default on a GPU: "
                                                        "8; dry: none)")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction,
                   help="each configuration in a child process of its own (default on a GPU: its peak memory is then "
                        "its own; --no-isolate: the largest so far)")
    args = p.parse_args(argv)
    started = time.monotonic()
    gpu, devices = local_devices()
    budget = args.budget_minutes if args.budget_minutes is not None else (8.0 if gpu else None)
    if not gpu and len(devices) < 2:
        raise SystemExit("the dry run needs 2 simulated CPU devices (jax_num_cpu_devices ≥ 2)")
    out = Path(args.out) if args.out else (RESULTS if gpu else None)
    save = None if out is None else (lambda partial: write({**partial, **{
        s: partial.get(s, {"skipped": "not run yet"}) for s in ("sequence_sweep", "context", "pipeline")},
        "partial": True}, out))
    result = check(gpu, devices, steps=args.steps or (10 if gpu else 2), warmup=2 if gpu else 1,
                   micro_batches=(args.micro_batch,) if args.micro_batch else ((4, 2, 1) if gpu else (2,)),
                   isolate=gpu if args.isolate is None else args.isolate, names=args.models,
                   peak_tflops_per_device=args.peak_tflops, save=save,
                   deadline=None if budget is None else started + 60 * budget,
                   policies=tuple(p for p in POLICIES if p == "none" or p in args.policies),
                   autotune_dir=autotune_dir(gpu, out), runs_log=runs_log(out, devices[0].device_kind))
    print(table(result))
    if out is not None:
        for path in write(result, out):
            print(f"wrote {path}")
    return result


def autotune_dir(gpu: bool, out: Path | None) -> Path | None:
    """`out`/autotune on a GPU (made here, before the children write into it); None on CPU or without `out`."""
    if not gpu or out is None:
        return None
    (out / "autotune").mkdir(parents=True, exist_ok=True)
    return out / "autotune"


def runs_log(out: Path | None, device_kind: str) -> Path | None:
    """`out`/gpu_<device kind>_<date>_runs.jsonl, emptied for this run (None without `out`): each configuration's
    result as it comes, beside the tables written at the end of each section."""
    if out is None:
        return None
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{file_stem(device_kind, datetime.datetime.now(datetime.timezone.utc).isoformat())}_runs.jsonl"
    path.write_text("")
    return path


def parent_allocates_lazily() -> None:
    """Before JAX starts: a parent that only plans must not take 75% of every GPU from its children. Its children
    preallocate as `jaxseq.train` does (`run_spec`): growing pools instead left a child whose step fits unable to
    place its largest buffer (2026-11-27, micro-batch 8)."""
    if "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ:
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        os.environ[PARENT_ONLY_PREALLOCATE] = "1"


def main() -> int:
    if "--child" in sys.argv:
        import jax

        jax.config.update("jax_num_cpu_devices", 2)
        spec = json.loads(sys.argv[sys.argv.index("--child") + 1])
        print("RESULT " + json.dumps(measure(spec, local_devices()[1])), flush=True)
        return 0
    parent_allocates_lazily()  # and a machine without a GPU gets simulated CPU devices:
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    sys.path.insert(0, str(ROOT))
    run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
