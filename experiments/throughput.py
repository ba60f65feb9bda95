"""Throughput of the training loop: tokens/s and TFLOP/s per device, and where a step's time goes.

    python experiments/throughput.py issue                  # issue 15's configuration, bf16 and f32, 3 rounds
    python experiments/throughput.py issue --baseline DIR   # … interleaved with another checkout (A B A B …)
    python experiments/throughput.py grid                   # dtype × remat × mesh × attention
    python experiments/throughput.py default                # `python -m jaxseq.train` (shortened to 200 steps)
    python experiments/throughput.py ceiling --baseline DIR # the issue's run with the attention deleted: an upper bound
    python experiments/throughput.py matmul                 # one dot, bf16 written three ways and f32: CPU s per dot
    python experiments/throughput.py family                 # issue 15's GPT beside a Llama of its size, interleaved
    python experiments/throughput.py report                 # results/throughput_tables.md from the JSON files

Every measurement runs the real command (`python -m jaxseq.train …`, the loop with its data, metrics,
progress bar and checkpoints) in a fresh child process, with `jax.stages.Compiled.__call__` wrapped so
that each train step's dispatch time is recorded and a watcher thread records when its outputs are
ready. From those timestamps, per step:

- period: step start to next step start (what tokens/s is made of);
- device: the compiled step's own time, end of the previous step (or this step's start, if later)
  to the end of this one;
- host: the device idle between the end of one step and the start of the next (data, metrics,
  logging, progress bar: anything the loop does while the device has nothing queued).

Steps that evaluate or checkpoint are left out of the medians (they are reported apart). After the
loop the same compiled step runs back-to-back (nothing else on the host) under `jax.profiler.trace`;
the trace's per-HLO-op events give the share of thread time in collectives, matmuls, converts,
copies/transposes and other fusions. On 8 simulated devices sharing a few cores a collective's time
is mostly waiting for the slowest peer, so the collective share says how much of the step is
synchronisation, not how many bytes moved.

Results go to experiments/results/throughput_*.json and are summarised in experiments/results/README.md
by hand (with the load average at the time: this machine is shared, so runs are interleaved and
medians are reported).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"

# Issue 15: GPT hidden 256, 4 heads × 64, MLP 1024, 2 layers, sequence 256, the 256-byte vocabulary
# (padded to 512), global batch 8, dropout 0, data=2 × tensor=4 + SP, full recompute, 8 CPU devices.
ISSUE_ARGS = ["--preset", "tiny", "--mesh", "data=2,tensor=4", "--sequence-parallel", "--remat", "full",
              "--steps", "30", "--batch-size", "8", "--seq-len", "256", "--log-every", "5",
              "--eval-every", "100000", "--checkpoint-every", "100000",
              "hidden=256", "heads=4", "layers=2", "mlp_ratio=4", "kv_channels=64", "dropout=0.0"]
# The Llama of ISSUE_ARGS's size and shapes: the same hidden, heads × width and layers; 4 K/V heads (no
# grouping: the same K/V matmuls); SwiGLU width 684 ≈ 8h/3 (3·h·684 weights ≈ GPT's 2·h·4h), divisible by
# tensor=4; its untied lm_head (257 × 256) in place of GPT's learned positions (256 × 256). Same mesh,
# policy, batch and sequence.
LLAMA_ARGS = ["--preset", "tiny-llama", *ISSUE_ARGS[2:], "kv_heads=4", "ffn_hidden=684"]
GRID = {
    "dtype": ("bfloat16", "float32"),
    "remat": ("full", "selective"),
    "mesh": ("data=2,tensor=4", "data=8,tensor=1"),
    "attention": ("explicit", "fused"),  # fused only on the first mesh (12 runs, about 25 minutes when shared)
}


# ---------------------------------------------------------------------------------------------
# The child: run the command with timestamps around every train step


class StepClock:
    """Wraps jax.stages.Compiled.__call__: dispatch time of each train-step call and, from a watcher
    thread, the time its outputs are ready."""

    def __init__(self):
        import jax

        self.starts: list[float] = []
        self.cpu: list[float] = []  # process CPU seconds (all threads) at each step start
        self.ends: dict[int, float] = {}
        self.last = None  # (compiled, outputs, args) of the latest step
        self._queue: list = []
        self._cv = threading.Condition()
        original = jax.stages.Compiled.__call__
        clock = self

        def timed(compiled, *args, **kwargs):
            if not _is_train_step(args):
                return original(compiled, *args, **kwargs)
            index = len(clock.starts)
            clock.starts.append(time.perf_counter())
            clock.cpu.append(time.process_time())
            out = original(compiled, *args, **kwargs)
            clock.last = (compiled, out, args)
            with clock._cv:
                clock._queue.append((index, out[1]))  # the metrics: never donated
                clock._cv.notify()
            return out

        jax.stages.Compiled.__call__ = timed
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self):
        import jax

        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                index, value = self._queue.pop(0)
            jax.block_until_ready(value)
            self.ends[index] = time.perf_counter()

    def wait(self):
        while len(self.ends) < len(self.starts):
            time.sleep(0.01)

    def steps(self) -> list[dict]:
        """Per step i ≥ 1: period (end of step i−1 to end of step i: what tokens/s is made of; start
        times are no measure, since the host dispatches ahead of the device), device (its own busy
        time) and host (the device idle before step i was dispatched)."""
        out = []
        for i in range(1, len(self.starts)):
            out.append({
                "period": self.ends[i] - self.ends[i - 1],
                "device": self.ends[i] - max(self.starts[i], self.ends[i - 1]),
                "host": max(0.0, self.starts[i] - self.ends[i - 1]),
            })
        return out


def _is_train_step(args) -> bool:
    return len(args) == 3 and type(args[0]).__name__ == "TrainState"


# The elementwise functions that tell which model op an "other" fusion computes, first found wins: sine/cosine
# (RoPE angles), logistic (SwiGLU's SiLU), tanh/erf (GELU), rsqrt (RMSNorm, LayerNorm), exponential (softmax).
TAGS = ("sine", "cosine", "logistic", "tanh", "erf", "rsqrt", "exponential")


def _ops_and_bodies(hlo_text: str):
    """(HLO op name, opcode, the text of the computation it calls or "", its own line) for each op of an
    optimized HLO text."""
    comps, current = {}, None
    for line in hlo_text.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m:
            current = m.group(1)
            comps[current] = []
        elif current:
            comps[current].append(line)
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (?:\S+|\(.*?\)) ([a-z][a-z0-9\-]*)\(", line)
        if m:
            called = re.search(r"calls=%?([\w.\-]+)", line)
            yield m.group(1), m.group(2), "\n".join(comps.get(called.group(1), [])) if called else "", line


def _tags(hlo_text: str) -> dict[str, str]:
    """HLO op name → the first of TAGS its fused computation holds ("plain" if none): what the "other"
    fusions are made of."""
    return {name: next((t for t in TAGS if f" {t}(" in (body or line)), "plain")
            for name, _, body, line in _ops_and_bodies(hlo_text)}


def profile_step(compiled, state, batch, key, steps: int) -> dict:
    """Back-to-back steps: wall time per step, and each op category's share of thread time in a trace."""
    import jax

    from jaxseq.planning import hlo_kernels

    for _ in range(2):
        state, out = compiled(state, batch, key)
    jax.block_until_ready(out)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        state, out = compiled(state, batch, key)
    jax.block_until_ready(out)
    alone = (time.perf_counter() - start) / steps
    alone_cpu = (time.process_time() - cpu) / steps
    kinds, tags = hlo_kernels.op_kinds(compiled.as_text()), _tags(compiled.as_text())
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(3):
                state, out = compiled(state, batch, key)
            jax.block_until_ready(out)
        data = jax.profiler.ProfileData.from_file(glob.glob(d + "/**/*.xplane.pb", recursive=True)[0])
    ns, top, other = collections.Counter(), collections.Counter(), collections.Counter()
    for line in data.find_plane_with_name("/host:CPU").lines:
        for e in line.events:
            stats = dict(e.stats)
            if "hlo_op" not in stats or not str(stats.get("hlo_module", "")).startswith("jit_step"):
                continue
            kind = kinds.get(e.name, "other")
            if kind:
                ns[kind] += e.duration_ns
                top[e.name] += e.duration_ns
                if kind == "other":
                    other[tags.get(e.name, "plain")] += e.duration_ns
    total = sum(ns.values()) or 1
    return {
        "step_alone_s": alone,
        "step_alone_cpu_s": alone_cpu,
        "thread_time_share": {k: v / total for k, v in ns.most_common()},
        # thread ms per step (the trace's 3 steps, all 8 devices' threads): by category, and the "other"
        # fusions by the elementwise function they compute (TAGS)
        "thread_ms_per_step": {k: v / 3 / 1e6 for k, v in ns.most_common()},
        "other_thread_ms_per_step": {k: v / 3 / 1e6 for k, v in other.most_common()},
        "top_ops": [(name, kinds.get(name), round(v / total, 4)) for name, v in top.most_common(12)],
        "hlo_op_counts": dict(collections.Counter(
            m for m in re.findall(r"= (?:\S+|\(.*?\)) ([a-z][a-z0-9\-]*)\(", compiled.as_text())).most_common(12)),
    }


def child(argv: list[str], profile: bool, without_attention: bool = False) -> dict:
    import jax

    if without_attention:  # the ceiling: each layer's attention replaced by its values (no QKᵀ, softmax, ×V)
        from jaxseq.models import gpt, llama

        gpt.attention = llama.attention = lambda q, k, v, *args, **kwargs: v
    clock = StepClock()
    from jaxseq import train

    with tempfile.TemporaryDirectory() as run_dir:
        t0 = time.perf_counter()
        rc = train.main(argv + ["--run-dir", run_dir])
        wall = time.perf_counter() - t0
        clock.wait()
        records = [r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if "run" not in r]
        config = json.load(open(os.path.join(run_dir, "config.json")))
    t = config["train"]
    steps = clock.steps()
    # steps[j] is training step j + 2, the one after step j + 1: the idle before it follows step j + 1.
    boundary = lambda n: n % t["eval_every"] == 0 or n % t["checkpoint_every"] == 0
    special = {j for j in range(len(steps)) if boundary(j + 1) or boundary(j + 2)}
    plain = [s for j, s in enumerate(steps) if j not in special and j >= 2]  # skip 2 warm-up steps
    med = {k: statistics.median(s[k] for s in plain) for k in ("period", "device", "host")}
    # CPU seconds per step over the steps after warm-up (evaluation/checkpoint steps included): unlike
    # wall time it hardly moves with other jobs' load on a shared machine.
    cpu_per_step = (clock.cpu[-1] - clock.cpu[2]) / (len(clock.cpu) - 3)
    tot = {k: sum(s[k] for s in plain) for k in ("period", "device", "host")}
    from jaxseq.training import metrics as Mx
    from jaxseq.config import ModelConfig
    from jaxseq.models.model import num_params

    cfg = ModelConfig(**config["model"])
    tps = Mx.throughput(cfg, t["remat"], t["batch_size"], 1, med["period"], jax.device_count(), None)
    result = {
        "argv": argv, "rc": rc, "wall_s": wall, "steps_timed": len(plain), "num_params": num_params(cfg),
        "median_period_s": med["period"], "median_device_s": med["device"], "median_host_s": med["host"],
        "host_share": tot["host"] / tot["period"],
        "cpu_s_per_step": cpu_per_step,
        "tokens_per_sec": tps["tokens_per_sec"], "tflops_per_device": tps["tflops_per_device"],
        "hardware_tflops_per_device": tps["hardware_tflops_per_device"],
        "logged_tokens_per_sec": [r["tokens_per_sec"] for r in records],  # the loop's own, per log window
        "special_steps_s": [steps[i]["period"] for i in sorted(special) if i < len(steps)],
        "host_ms_per_step": [round(s["host"] * 1e3, 2) for s in steps],
        "load_average": os.getloadavg(),
    }
    if profile and clock.last is not None:
        compiled, out, args = clock.last
        result["profile"] = profile_step(compiled, out[0], args[1], args[2], steps=5)
    return result


# ---------------------------------------------------------------------------------------------
# The parent: runs children (optionally against another checkout), interleaved


def run_child(argv: list[str], code: Path, profile: bool = False, without_attention: bool = False) -> dict:
    env = dict(os.environ, PYTHONPATH=str(code))
    cmd = [sys.executable, str(Path(__file__).resolve()), "child", "--code", str(code)]
    cmd += ["--profile"] if profile else []
    cmd += ["--without-attention"] if without_attention else []
    cmd += ["--", *argv]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(code))
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _summary(r: dict) -> str:
    return (f"{r['tokens_per_sec']:8.0f} tokens/s  {r['tflops_per_device'] * 1e3:6.2f} GFLOP/s/device  "
            f"step {r['median_period_s'] * 1e3:6.1f} ms (device {r['median_device_s'] * 1e3:6.1f}, "
            f"host {r['median_host_s'] * 1e3:5.2f}; host share {r['host_share'] * 100:4.1f}%)  "
            f"CPU {r['cpu_s_per_step'] * 1e3:6.1f} ms/step  "
            f"load {r['load_average'][0]:.1f}")


def issue(args) -> dict:
    codes = {"new": ROOT}
    if args.baseline:
        codes["baseline"] = Path(args.baseline).resolve()
    out = {"command": " ".join(sys.argv), "issue_args": ISSUE_ARGS, "rounds": []}
    for r in range(args.rounds):
        for dtype in args.dtypes:
            for name, code in (codes.items() if r % 2 == 0 else reversed(list(codes.items()))):
                res = run_child(ISSUE_ARGS + ["--dtype", dtype], code, profile=args.profile and r == 0)
                res.update(code=name, dtype=dtype, round=r)
                out["rounds"].append(res)
                print(f"round {r} {name:8s} {dtype:8s} {_summary(res)}", flush=True)
    out["medians"] = {}
    for dtype in args.dtypes:
        for name in codes:
            runs = [x for x in out["rounds"] if x["code"] == name and x["dtype"] == dtype]
            out["medians"][f"{name}/{dtype}"] = {k: statistics.median(x[k] for x in runs) for k in
                                                 ("tokens_per_sec", "tflops_per_device", "median_device_s",
                                                  "median_host_s", "host_share", "cpu_s_per_step")}
        if args.baseline:
            ratio = (out["medians"][f"new/{dtype}"]["tokens_per_sec"]
                     / out["medians"][f"baseline/{dtype}"]["tokens_per_sec"])
            out["medians"][f"speedup/{dtype}"] = ratio
            cpu = (out["medians"][f"baseline/{dtype}"]["cpu_s_per_step"]
                   / out["medians"][f"new/{dtype}"]["cpu_s_per_step"])
            out["medians"][f"cpu_speedup/{dtype}"] = cpu
            print(f"{dtype}: new / baseline tokens/s (medians) = {ratio:.3f}; "
                  f"baseline / new CPU s per step = {cpu:.3f}")
    return out


def ceiling(args) -> dict:
    """How fast the issue's run could get by removing work from the attention alone: the same command
    with each layer's attention replaced by its values (`attention(q, k, v) = v`: no QKᵀ, mask, softmax
    or ×V, forward, replay or backward), interleaved with the code as it is and the baseline. Not a
    model anyone should train: an upper bound on what any attention kernel (causal block skipping,
    other layouts) could buy on this CPU."""
    runs = {"new": (ROOT, False), "new_without_attention": (ROOT, True)}
    if args.baseline:
        runs["baseline"] = (Path(args.baseline).resolve(), False)
    out = {"command": " ".join(sys.argv), "issue_args": ISSUE_ARGS, "rounds": []}
    for r in range(args.rounds):
        for dtype in args.dtypes:
            for name, (code, without) in (runs.items() if r % 2 == 0 else reversed(list(runs.items()))):
                res = run_child(ISSUE_ARGS + ["--dtype", dtype], code, without_attention=without)
                res.update(code=name, dtype=dtype, round=r)
                out["rounds"].append(res)
                print(f"round {r} {name:22s} {dtype:8s} {_summary(res)}", flush=True)
    out["medians"] = {}
    for dtype in args.dtypes:
        for name in runs:
            xs = [x for x in out["rounds"] if x["code"] == name and x["dtype"] == dtype]
            out["medians"][f"{name}/{dtype}"] = {k: statistics.median(x[k] for x in xs)
                                                 for k in ("tokens_per_sec", "cpu_s_per_step")}
        top = out["medians"][f"new_without_attention/{dtype}"]
        for name in (n for n in runs if n != "new_without_attention"):
            ref = out["medians"][f"{name}/{dtype}"]
            ratio = top["tokens_per_sec"] / ref["tokens_per_sec"]
            out["medians"][f"ceiling_over_{name}/{dtype}"] = ratio
            print(f"{dtype}: without attention / {name} tokens/s (medians) = {ratio:.3f}, "
                  f"CPU s per step {ref['cpu_s_per_step'] / top['cpu_s_per_step']:.3f}")
    return out


def family(args) -> dict:
    """Issue 15's GPT beside the Llama of its size (LLAMA_ARGS), interleaved (A B B A …), the first round
    profiled: tokens/s, the step's median times and its thread time by op category, per family and dtype,
    and the Llama / GPT ratios. Both runs do the same matmuls (to 0.2%), so what differs is the elementwise
    work (RMSNorm, RoPE, SwiGLU against LayerNorm, learned positions, GELU) and how XLA fuses it."""
    runs = {"gpt": ISSUE_ARGS, "llama": LLAMA_ARGS}
    out = {"command": " ".join(sys.argv), "args": runs, "rounds": []}
    for r in range(args.rounds):
        for dtype in args.dtypes:
            for name, argv in (runs.items() if r % 2 == 0 else reversed(list(runs.items()))):
                res = run_child(argv + ["--dtype", dtype], ROOT, profile=r == 0)
                res.update(family=name, dtype=dtype, round=r)
                out["rounds"].append(res)
                print(f"round {r} {name:6s} {dtype:8s} {_summary(res)}  {_shares(res)}", flush=True)
    out["medians"] = {}
    for dtype in args.dtypes:
        for name in runs:
            xs = [x for x in out["rounds"] if x["family"] == name and x["dtype"] == dtype]
            out["medians"][f"{name}/{dtype}"] = {k: statistics.median(x[k] for x in xs) for k in
                                                 ("tokens_per_sec", "median_device_s", "median_host_s",
                                                  "cpu_s_per_step", "tflops_per_device")}
        gpt, llama = out["medians"][f"gpt/{dtype}"], out["medians"][f"llama/{dtype}"]
        out["medians"][f"llama_over_gpt/{dtype}"] = {k: llama[k] / gpt[k] for k in gpt if gpt[k]}
        print(f"{dtype}: llama / gpt tokens/s (medians) = {llama['tokens_per_sec'] / gpt['tokens_per_sec']:.3f}, "
              f"CPU s per step {llama['cpu_s_per_step'] / gpt['cpu_s_per_step']:.3f}", flush=True)
    return out


def matmul(args) -> dict:
    """One weight matmul of issue 15's step per device ([b·s, h] × [h, n] at data=2 × tensor=4: 1024 tokens,
    h = 256) on one CPU device, written as a plain bf16 dot, as a bf16 × bf16 → f32 dot, as that dot
    rounded to bf16 (models/cpu_matmul.py's form) and in f32; CPU seconds per dot (median of 5 × 50 calls)
    and whether XLA ran it on its YNNPACK kernels with bf16 operands (hlo_flops.dots on the optimized HLO)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    jax.config.update("jax_num_cpu_devices", 1)
    sys.path.insert(0, str(ROOT))
    from jaxseq.planning import hlo_flops

    forms = {
        "bf16 dot (plain einsum)": lambda a, b: a @ b,
        "bf16 x bf16 -> f32": lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32),
        "bf16 x bf16 -> f32 -> bf16 (models/cpu_matmul on CPU)":
            lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16),
        "f32 dot": lambda a, b: a.astype(jnp.float32) @ b.astype(jnp.float32),
    }
    out = {"command": " ".join(sys.argv), "cpu": _cpu_name(), "shapes": []}
    for m, k, n in ((1024, 256, 192), (1024, 256, 256), (1024, 256, 1024), (1024, 1024, 256)):
        a = jnp.asarray(np.random.default_rng(0).standard_normal((m, k)), jnp.bfloat16)
        b = jnp.asarray(np.random.default_rng(1).standard_normal((k, n)), jnp.bfloat16)
        row = {"m": m, "k": k, "n": n, "forms": {}}
        for name, fn in forms.items():
            f = jax.jit(fn)
            dots = hlo_flops.dots(f.lower(a, b).compile().as_text())
            jax.block_until_ready(f(a, b))
            cpu = []
            for _ in range(5):
                c = time.process_time()
                for _ in range(50):
                    r = f(a, b)
                jax.block_until_ready(r)
                cpu.append((time.process_time() - c) / 50)
            s = statistics.median(cpu)
            row["forms"][name] = {"cpu_ms": s * 1e3, "gflop_per_cpu_s": 2 * m * k * n / s / 1e9,
                                  "dot_operands": [list(d.operands) for d in dots]}
            print(f"{m}x{k}x{n} {name:48s} {s * 1e3:6.3f} ms CPU  {2 * m * k * n / s / 1e9:6.1f} GFLOP per CPU-s  "
                  f"operands {[d.operands for d in dots]}", flush=True)
        out["shapes"].append(row)
    return out


def _cpu_name() -> str:
    try:
        return next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        return "?"


def grid(args) -> dict:
    out = {"command": " ".join(sys.argv), "runs": []}
    base = [a for a in ISSUE_ARGS]
    for dtype in GRID["dtype"]:
        for remat in GRID["remat"]:
            for mesh in GRID["mesh"]:
                for attention in GRID["attention"] if mesh == GRID["mesh"][0] else GRID["attention"][:1]:
                    argv = _set(base, {"--remat": remat, "--mesh": mesh}) + ["--dtype", dtype, "--attention", attention]
                    if mesh.endswith("tensor=1"):
                        argv = [a for a in argv if a != "--sequence-parallel"] + ["--no-sequence-parallel"]
                    res = run_child(argv, ROOT, profile=args.profile)
                    res.update(dtype=dtype, remat=remat, mesh=mesh, attention=attention)
                    out["runs"].append(res)
                    print(f"{dtype:8s} {remat:9s} {mesh:15s} {attention:8s} {_summary(res)}", flush=True)
    return out


def default(args) -> dict:
    argv = ["--steps", str(args.steps)]
    res = run_child(argv, ROOT, profile=args.profile)
    print(f"default run ({args.steps} steps): {_summary(res)}", flush=True)
    return {"command": " ".join(sys.argv), "run": res}


def _set(argv: list[str], values: dict) -> list[str]:
    argv = list(argv)
    for flag, value in values.items():
        argv[argv.index(flag) + 1] = value
    return argv


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    labels = [f"{r['dtype'][:4]} {r['remat'][:4]}\n"
              f"{r['mesh'].replace('data=', 'd').replace(',tensor=', 't')} {r['attention'][:4]}"
              for r in runs]
    device = [r["median_device_s"] * 1e3 for r in runs]
    host = [r["median_host_s"] * 1e3 for r in runs]
    cpu = [r["cpu_s_per_step"] * 1e3 for r in runs]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(15, 4.8))
    ax.bar(range(len(runs)), device, label="device (compiled step)")
    ax.bar(range(len(runs)), host, bottom=device, label="host between steps")
    for i, r in enumerate(runs):
        ax.text(i, device[i] + host[i], f"{r['tokens_per_sec'] / 1e3:.1f}k\nL{r['load_average'][0]:.0f}",
                ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(runs)), labels, fontsize=6)
    ax.set_ylim(0, max(d + h for d, h in zip(device, host)) * 1.15)
    ax.set_ylabel("median wall ms per step")
    ax.set_title("Wall time per step (labels: tokens/s, load average): moves with other jobs' load", fontsize=9)
    ax.legend(fontsize=7)
    bx.bar(range(len(runs)), cpu, color="tab:green")
    bx.set_xticks(range(len(runs)), labels, fontsize=6)
    bx.set_ylabel("process CPU ms per step (all threads)")
    bx.set_title("CPU time per step: the work, far less load-sensitive", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _shares(r: dict) -> str:
    shares = r.get("profile", {}).get("thread_time_share", {})
    return " / ".join(f"{shares.get(k, 0) * 100:.0f}"
                      for k in ("collective", "matmul", "convert", "copy/transpose", "other"))


def report(args) -> dict:
    """experiments/results/throughput_tables.md from the JSON results present."""
    lines = []
    issue_path, grid_path, default_path = (RESULTS / f"throughput_{m}.json" for m in ("issue", "grid", "default"))
    head = ("| tokens/s | GFLOP/s per device (model) | step, ms | device, ms | host, ms | host share | CPU s per step "
            "| thread time: collective / matmul / convert / copy / other, % | load |")
    rule = "| " + " | ".join(["---"] * 9) + " |"
    row = lambda r: (f"{r['tokens_per_sec']:.0f} | {r['tflops_per_device'] * 1e3:.2f} | "
                     f"{r['median_period_s'] * 1e3:.0f} | {r['median_device_s'] * 1e3:.0f} | "
                     f"{r['median_host_s'] * 1e3:.1f} | {r['host_share'] * 100:.1f}% | {r['cpu_s_per_step']:.3f} | "
                     f"{_shares(r) if 'profile' in r else ''} | {r['load_average'][0]:.1f} |")
    if issue_path.exists():
        res = json.loads(issue_path.read_text())
        lines += ["## Issue 15's configuration, interleaved runs", "", f"`{res['command']}`", "",
                  "| run | code | dtype " + head, "| --- | --- | --- " + rule]
        lines += [f"| {r['round']} | {r['code']} | {r['dtype']} | " + row(r) for r in res["rounds"]]
        lines += ["", "| medians | tokens/s | CPU s per step | host share |", "| --- | --- | --- | --- |"]
        for k, m in res["medians"].items():
            if isinstance(m, dict):
                lines.append(f"| {k} | {m['tokens_per_sec']:.0f} | {m['cpu_s_per_step']:.3f} | "
                             f"{m['host_share'] * 100:.1f}% |")
        for k, m in res["medians"].items():
            if not isinstance(m, dict):
                lines.append(f"\n{k}: **{m:.3f}**")
        lines.append("")
    if default_path.exists():
        r = json.loads(default_path.read_text())["run"]
        lines += ["## The default run (`python -m jaxseq.train`, first 200 steps)", "", "| " + head[2:], rule,
                  "| " + row(r), ""]
    if grid_path.exists():
        res = json.loads(grid_path.read_text())
        lines += ["## Grid (issue 15's model, 30 steps each)", "", f"`{res['command']}`", "",
                  "| dtype | remat | mesh | attention " + head, "| --- | --- | --- | --- " + rule]
        lines += [f"| {r['dtype']} | {r['remat']} | {r['mesh']} | {r['attention']} | " + row(r) for r in res["runs"]]
        lines.append("")
    (RESULTS / "throughput_tables.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return {}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("issue", "ceiling", "grid", "default", "matmul", "family", "report", "child"))
    p.add_argument("--baseline", help="issue: another checkout to interleave with (its root, used as PYTHONPATH)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--steps", type=int, default=200, help="default: steps of the default run")
    p.add_argument("--profile", action="store_true", help="also profile the compiled step (op categories)")
    p.add_argument("--out", help="JSON output (default experiments/results/throughput_MODE.json)")
    p.add_argument("--code", help=argparse.SUPPRESS)
    p.add_argument("--without-attention", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[: len(argv) - len(rest) - (1 if "--" in argv else 0)])
    args.argv = rest
    if args.mode == "child":
        sys.path.insert(0, args.code)
        print("RESULT " + json.dumps(child(args.argv, args.profile, args.without_attention)), flush=True)
        return 0
    if args.mode == "report":
        report(args)
        return 0
    result = {"issue": issue, "ceiling": ceiling, "grid": grid, "default": default, "matmul": matmul,
              "family": family}[args.mode](args)
    result["load_average_end"] = os.getloadavg()
    out = Path(args.out) if args.out else RESULTS / f"throughput_{args.mode}.json"
    out.write_text(json.dumps(result, indent=1))
    if args.mode == "grid":
        plot(result, out.with_suffix(".png"))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
