"""The plan against the GPU: every configuration the H100 measured (experiments/results/gpu_h100_2026-11-26/), its
peak memory as measured, as `plan --target h100` predicts it (XLA:GPU's program, compiled here without a GPU) and as
the CPU plan predicts it (XLA:CPU on simulated devices, what `plan` gives without --target), with each error.

    pip install -r requirements-gpu-target.txt
    python experiments/gpu_target.py      # writes experiments/results/gpu_target_vs_measured.{json,md}
                                          # (6 min 12 s on the 2-core machine)

Then, per remat policy, what the step compiled for the GPU does: its dot FLOPs (whole step, per layer-loop
iteration), where its cuDNN attention calls are, what it stores per layer, and the search's time model against the
measured step time; and the bytes its memory-bound kernels move (`hlo_kernels.kernel_bytes`: storing and re-reading
activations included), with the step priced on them (`search_time.program_step_time`, what `plan --search --target
--verify` reports) against the same measured times.

Peaks measured: `memory_stats()["peak_bytes_in_use"]` of each configuration alone in its process (experiments/gpu.py).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "experiments" / "results"
MEASURED = RESULTS / "gpu_h100_2026-11-26"
POLICIES = ("none", "selective", "lean", "full")
MIB = 2**20


def measured_runs() -> dict:
    """model name → (ModelConfig as the GPU ran it, micro-batch, {policy: peak bytes})."""
    from jaxseq.config import ModelConfig
    from jaxseq.models.model import saved_model_fields

    runs = {}
    for path in sorted(MEASURED.glob("h100_*_mb*.json")):
        for name, model in json.loads(path.read_text())["models"].items():
            peaks = {p: model["policies"][p]["peak_bytes_in_use"] for p in POLICIES}
            runs[name] = (ModelConfig(**saved_model_fields(model["config"])), model["micro_batch"], peaks)
    return runs


def compare(target: str = "h100") -> list[dict]:
    import jax

    from jaxseq.config import ParallelConfig, replace
    from jaxseq.planning import gpu_target
    from jaxseq.planning.plan import plan

    rows = []
    for name, (cfg, micro_batch, peaks) in measured_runs().items():
        searched = {where: search_memory(cfg, micro_batch, where, target) for where in ("cpu", "target")}
        start = time.perf_counter()
        cpu_plan = plan(replace(cfg, fused_kernel="xla", matmul="einsum"), 1, micro_batch, jax.devices("cpu")[:1], name,
                        policies=POLICIES)  # what `plan` gives: the portable model on XLA:CPU
        cpu_s = time.perf_counter() - start
        for policy in POLICIES:
            start = time.perf_counter()
            target_bytes = gpu_target.step_bytes(cfg, ParallelConfig(), policy, micro_batch, 1, target)
            rows.append({"model": name, "remat": policy, "micro_batch": micro_batch, "measured_bytes": peaks[policy],
                         "target_bytes": target_bytes, "cpu_plan_bytes": cpu_plan.row(policy).total_bytes_per_device,
                         "target_compile_s": time.perf_counter() - start, "cpu_plan_s": cpu_s,
                         "search_target_bytes": searched["target"][policy][0],
                         "search_cpu_bytes": searched["cpu"][policy][0], "search_cpu_s": searched["cpu"][policy][1]})
    for r in rows:
        for column in ("target", "cpu_plan", "search_target", "search_cpu"):
            r[f"{column}_error"] = r[f"{column}_bytes"] / r["measured_bytes"] - 1
    return rows


@functools.lru_cache(maxsize=None)
def target_layers(cfg, target: str):
    """`plan --search --target`'s layer costs (`SearchCosts`, its layers compiled for the GPU) for cfg's shape: compiled
    once per shape and policy, and read by every table here (the search's, the remat policies', the later shapes').
    An unrolled model's layers are measured scanned (`measure.Compiler`)."""
    from jaxseq.config import on_platform, replace
    from jaxseq.planning import gpu_target
    from jaxseq.planning.search_costs import SearchCosts

    return SearchCosts(on_platform(replace(cfg, layer_loop="scan"), "gpu"), gpu_target.target_devices(target, 1))


def search_memory(cfg, micro_batch: int, where: str, target: str) -> dict:
    """policy → `plan --search`'s memory (the parts added up) and step time for this one-GPU configuration, its
    layers compiled by XLA:CPU or for the GPU (`--target`)."""
    import jax

    from jaxseq.config import on_platform, replace
    from jaxseq.hardware import HARDWARE
    from jaxseq.planning import search_space
    from jaxseq.planning.search import search
    from jaxseq.planning.search_costs import SearchCosts

    portable = replace(cfg, fused_kernel="xla", matmul="einsum")
    cfg, costs = ((on_platform(cfg, "gpu"), target_layers(cfg, target)) if where == "target"
                  else (portable, SearchCosts(portable, jax.devices("cpu")[:1])))
    request = search_space.Request(1, micro_batch, HARDWARE[target], (micro_batch,), POLICIES, search_space.TimeModel(),
                                   (1,), (1,))
    result = search(cfg, request, costs, target=target if where == "target" else None)
    return {e.candidate.remat: (e.memory.total_bytes, e.time.total_s) for e in result.ranked}


LATER = RESULTS / "gpu_h100_2026-11-27"  # experiments/gpu.py and gpu_followup.py on an H100, at other shapes
THIRD = RESULTS / "gpu_2026-11-27_autotune" / "h100"  # experiments/gpu.py on an H100 again: `lean` unrolled


def later_runs() -> list[dict]:
    """What the H100 measured on 2026-11-27 with today's program: gpt3-1.3b's rows at micro-batch 4 again, `lean` at
    three sequence lengths, `none` at micro-batch 8 and `full` at 32 (preallocated, gpu_followup.py), and unrolled
    layers (`lax.split`, followup_2_unstack.json), and `lean` unrolled from a third run (the rest of that run repeats
    these shapes): each a config, policy, micro-batch, peak and median step."""
    from jaxseq.config import ModelConfig, replace
    from jaxseq.models.model import saved_model_fields

    check = json.loads((LATER / "gpu.json").read_text())
    model = check["models"]["gpt3-1.3b"]
    cfg = ModelConfig(**saved_model_fields(model["config"]))
    row = lambda label, cfg, policy, b, run: {"label": label, "config": cfg, "remat": policy, "micro_batch": b,
                                              "measured_bytes": run["peak_bytes_in_use"],
                                              "measured_step_s": run["median_step_s"]}
    rows = [row(f"{p}, b={model['micro_batch']}", cfg, p, model["micro_batch"], r)
            for p, r in model["policies"].items()]
    rows += [row(f"lean, s={r['seq_len']}, b={r['micro_batch']}", replace(cfg, seq_len=r["seq_len"]), "lean",
                 r["micro_batch"], r) for r in check["sequence_sweep"]["runs"]]
    followup = json.loads((LATER / "followup_1.json").read_text())["runs"]
    rows += [row("none, b=8", cfg, "none", 8, followup["none_micro_batch_8"]),
             row("full, b=32", cfg, "full", 32, followup["full_micro_batch_32"])]
    unrolled = json.loads((LATER / "followup_2_unstack.json").read_text())["runs"]
    rows += [row(f"{p}, unrolled, b=4", replace(cfg, layer_loop="unrolled"), p, 4, unrolled[name])
             for p, name in (("none", "unrolled_none"), ("full", "unrolled_full"))]
    (third,) = json.loads((THIRD / "gpu.json").read_text())["models"].values()  # the one shape it added
    return rows + [row("lean, unrolled, b=4 (third run)", replace(cfg, layer_loop="unrolled"), "lean", 4,
                       third["unrolled"]["lean"])]


def later_shapes(target: str = "h100") -> list[dict]:
    """Each of `later_runs`: `plan --target`'s peak (the larger of the Triton and cuBLAS programs, and each), and
    against the measured step: the search's time model with its layer compiled for the GPU (`plan --search --target`:
    stored bytes, the bytes its loops move), the same with Megatron's kernels counted in place of those bytes (what
    a layer compiled by XLA:CPU gets), and the step priced on its (Triton) program."""
    import jax

    from jaxseq.config import ParallelConfig, replace
    from jaxseq.hardware import HARDWARE
    from jaxseq.planning import gpu_target, hlo_kernels, search_memory
    from jaxseq.planning.search_costs import SearchCosts
    from jaxseq.planning.search_space import Candidate, TimeModel
    from jaxseq.planning.search_time import program_step_time, step_time
    from jaxseq.training import aot

    hw, out = HARDWARE[target], []
    for r in later_runs():
        cfg, policy, b = r["config"], r["remat"], r["micro_batch"]
        programs = {g: gpu_target.compile_step(cfg, ParallelConfig(), policy, b, 1, target, g)
                    for g in gpu_target.GEMMS}
        peaks = {g: aot.step_bytes(c) for g, c in programs.items()}
        state = SearchCosts(cfg, jax.devices("cpu")[:1]).state(cfg, 1, 1, False, 1)
        layer = target_layers(cfg, target).layer(1, False, policy, b)
        tm = TimeModel(scan_stacks=cfg.layer_loop == "scan")
        c = Candidate(1, 1, 1, 1, b, policy, False, False, 1)
        moved = hlo_kernels.memory_bound_bytes(programs["triton"].as_text())
        out.append({**{k: v for k, v in r.items() if k != "config"}, "seq_len": cfg.seq_len,
                    "layer_loop": cfg.layer_loop, "target_bytes": max(peaks.values()), "triton_bytes": peaks["triton"],
                    "cublas_bytes": peaks["cublas"],
                    "stored_bytes_per_layer": layer.stored_bytes, "moved_bytes_per_layer": layer.moved_bytes,
                    "memory_bound_bytes": moved, "search_bytes": search_memory.memory(cfg, c, layer, state).total_bytes,
                    "model_step_s": step_time(cfg, c, layer, state, hw, tm).total_s,
                    "model_counted_step_s": step_time(cfg, c, replace(layer, moved_bytes=None), state, hw, tm).total_s,
                    "program_step_s": program_step_time(cfg, c, layer, state, hw, tm, moved).total_s})
    return out


def later_table(rows: list[dict]) -> str:
    error = lambda r, key, measured: f"{100 * (r[key] / r[measured] - 1):+.1f}%"
    lines = ["## Shapes measured later: gpt3-1.3b on the H100, 2026-11-27", "",
             f"Measured with today's program ({LATER.relative_to(ROOT)}: experiments/gpu.py, then gpu_followup.py "
             "for micro-batches 8 and 32 preallocated and for unrolled layers after `models.model.unstack`). "
             "--target: the larger of the step compiled with Triton's GEMMs (XLA's choice without a device) and with "
             "cuBLAS's (`gpu_target.step_bytes`), MiB per device. Model: `plan --search --target`'s time model, its "
             "layer compiled for the GPU (the stored bytes, and the bytes its loops move: `LayerCost.moved_bytes`, "
             "read at micro-batches 1 and 2; the scan's stacks taken out for unrolled layers); counted: the same with "
             "Megatron's kernels counted in place of those bytes (what a layer compiled by XLA:CPU gets, without "
             "--target); program: the step priced on its Triton program (`plan --search --target --verify`'s GPU s). "
             "Search: `plan --search --target`'s memory, the parts added up (`search_memory.memory`: the state's "
             "share of the peak, stored × layers, working), its layer compiled for the GPU scanned. "
             "Nothing is fitted to these runs.", "",
             "| configuration | measured MiB | --target | error | Triton | cuBLAS | search | error | measured s | "
             "model s | error | counted s | error | program s | error |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['measured_bytes'] / MIB:,.0f} | {r['target_bytes'] / MIB:,.0f} | "
                     f"{error(r, 'target_bytes', 'measured_bytes')} | {r['triton_bytes'] / MIB:,.0f} | "
                     f"{r['cublas_bytes'] / MIB:,.0f} | {r['search_bytes'] / MIB:,.0f} | "
                     f"{error(r, 'search_bytes', 'measured_bytes')} | {r['measured_step_s']:.4f} | "
                     f"{r['model_step_s']:.4f} | "
                     f"{error(r, 'model_step_s', 'measured_step_s')} | {r['model_counted_step_s']:.4f} | "
                     f"{error(r, 'model_counted_step_s', 'measured_step_s')} | {r['program_step_s']:.4f} | "
                     f"{error(r, 'program_step_s', 'measured_step_s')} |")
    worst = lambda key, measured: max(abs(100 * (r[key] / r[measured] - 1)) for r in rows)
    lines += ["", f"Largest |error|: --target {worst('target_bytes', 'measured_bytes'):.1f}% (Triton's program alone "
              f"{worst('triton_bytes', 'measured_bytes'):.1f}%), the search's parts "
              f"{worst('search_bytes', 'measured_bytes'):.1f}%, "
              f"the time model {worst('model_step_s', 'measured_step_s'):.1f}% "
              f"(counted kernels {worst('model_counted_step_s', 'measured_step_s'):.1f}%), "
              f"the program {worst('program_step_s', 'measured_step_s'):.1f}%."]
    return "\n".join(lines) + "\n"


def remat_on_gpu(target: str = "h100") -> list[dict]:
    """Per model and policy, what the train step compiled for the GPU does (its dot FLOPs: every weight GEMM, the
    attention core being cuDNN's; per backward layer iteration; the cuDNN attention calls in each layer loop), what
    it stores per layer (XLA:GPU's layer program), the time model's step time and the measured one."""
    import re

    import jax

    from jaxseq.config import ParallelConfig
    from jaxseq.hardware import HARDWARE
    from jaxseq.planning import gpu_target, hlo, hlo_flops, hlo_kernels
    from jaxseq.planning import kernel_time as K
    from jaxseq.planning.search_costs import SearchCosts
    from jaxseq.planning.search_space import Candidate, TimeModel
    from jaxseq.planning.search_time import program_step_time, step_time

    rows = []
    for name, (cfg, micro_batch, _) in measured_runs().items():
        runs = json.loads(next(MEASURED.glob(f"h100_{name}_mb*.json")).read_text())["models"][name]["policies"]
        state = SearchCosts(cfg, jax.devices("cpu")[:1]).state(cfg, 1, 1, False, 1)
        for policy in POLICIES:
            text = gpu_target.compile_step(cfg, ParallelConfig(), policy, micro_batch, 1, target).as_text()
            comps = hlo.parse_hlo(text)
            loops = {ins.attr("body"): ins.trip_count() for instrs in comps.values() for ins in instrs
                     if ins.opcode == "while" and ins.trip_count() == cfg.layers}
            # the backward does more
            forward, backward = sorted(loops, key=lambda body: hlo_flops.dot_flops(comps, body))
            calls = lambda body: sorted(re.findall(f'custom_call_target="({re.escape(hlo.CUDNN_ATTENTION)}[^"]*)"',
                                                   "\n".join(i.rest for i in comps[body])))
            # the bytes the memory-bound kernels move: in each layer loop, outside
            kernel_bytes = hlo_kernels.kernel_bytes(text)
            memory_bound = hlo_kernels.MEMORY_BOUND_KINDS
            moved = {place: sum(b for kind, b in kernel_bytes.get(body, {}).items() if kind in memory_bound)
                     for place, body in (("forward", forward), ("backward", backward))}
            moved["outside"] = sum(b for body, kinds in kernel_bytes.items() if body not in loops
                                   for kind, b in kinds.items() if kind in memory_bound)
            hw, tm = HARDWARE[target], TimeModel()
            layer = target_layers(cfg, target).layer(1, False, policy, micro_batch)
            c = Candidate(1, 1, 1, 1, micro_batch, policy, False, False, 1)
            # the measured program ran cuDNN's attention forward again in the backward under every policy
            replayed = (0.0 if policy == "full"
                        else cfg.layers * K.fused_attention_seconds(cfg, micro_batch, 1, policy, hw)[0])
            model = step_time(cfg, c, layer, state, hw, tm)
            on_program = program_step_time(cfg, c, layer, state, hw, tm, sum(moved.values()))
            rows.append({
                "model": name, "remat": policy,
                "dot_tflop": hlo_flops.dot_flops(comps, hlo.entry_name(text)) / 1e12,
                "forward_layer_dot_tflop": hlo_flops.dot_flops(comps, forward) / 1e12,
                "backward_layer_dot_tflop": hlo_flops.dot_flops(comps, backward) / 1e12,
                "forward_loop_cudnn": calls(forward), "backward_loop_cudnn": calls(backward),
                "stored_bytes_per_layer": layer.stored_bytes, "moved_bytes_per_layer": layer.moved_bytes,
                "replayed_attention_s": replayed, "model_step_s": model.total_s + replayed,
                "model_optimizer_s": model.optimizer_s,
                "non_gemm_bytes": moved, "program_step_s": on_program.total_s + replayed,
                "measured_step_s": runs[policy]["median_step_s"]})
    return rows


def remat_table(rows: list[dict]) -> str:
    lines = ["## The remat policies in the GPU's program", "",
             "Dot FLOPs: every weight GEMM of the whole step (the attention core is cuDNN's custom call, not a dot), "
             "from the step compiled for the H100 (`hlo_flops.dot_flops`: a loop body × its trip count). "
             "Stored: XLA:GPU's "
             "layer program. Measured: the H100's steps of 2026-11-26, whose program called cuDNN's attention as it "
             "is: its forward kernel ran again in the backward loop under every policy; today's (jaxseq's VJP, "
             "models/cudnn_attention.py) runs it there only under `full`. Both predictions below add that kernel "
             "(`fused_attention_seconds`' forward, per layer) to `none`, `selective` and `lean` to price the program "
             "that was measured; without it they are today's.", "",
             "| model | remat | dot TFLOP | vs none | backward layer TFLOP | cuDNN in backward loop | stored MiB/layer "
             "| measured s |", "|---|---|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        none = next(x for x in rows if x["model"] == r["model"] and x["remat"] == "none")
        lines.append(f"| {r['model']} | {r['remat']} | {r['dot_tflop']:.2f} | "
                     f"{100 * (r['dot_tflop'] / none['dot_tflop'] - 1):+.1f}% "
                     f"| {r['backward_layer_dot_tflop']:.3f} | {', '.join(r['backward_loop_cudnn'])} | "
                     f"{r['stored_bytes_per_layer'] / MIB:,.1f} | {r['measured_step_s']:.4f} |")
    lines += ["", "## The step time: the search's model, and the step priced on the GPU's program", "",
              "Memory-bound GB: what the compiled step's kernels other than GEMMs, attention and collectives read and "
              "write (`hlo_kernels.kernel_bytes`: a fusion's parameters and result, a stacked buffer's slice and "
              "update only; "
              "loop bodies × their trip count), in the forward layer loop, the backward one and outside them (the "
              "optimizer, embedding, loss, the stacked buffers' zero fill). Model: `plan --search --target h100`'s "
              "time model (`search_time.step_time`: GEMMs from shapes, cuDNN's attention at its published rates, the "
              "bytes the layer loops of its layer's GPU program move (`LayerCost.moved_bytes`) + its stacks' zero "
              "fill, the "
              "optimizer step); with CPU layers: the same search's time without --target (its layers compiled by "
              "XLA:CPU: Megatron's elementwise kernels counted, the stored bytes and the layer's weights through the "
              "scan's stacks). Program: the step priced on its compiled program "
              "(`search_time.program_step_time`, the GPU s column of `plan --search --target h100 --verify`: the "
              "same GEMMs and attention, these bytes at 0.88 of HBM bandwidth). Nothing is fitted to these runs.", "",
              "| model | remat | forward loop GB | backward loop GB | outside GB | total GB | vs none | model s | "
              "error | model, CPU layers s | error | program s | error | measured s |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    gb = lambda r: sum(r["non_gemm_bytes"].values()) / 1e9
    error = lambda r, key: f"{100 * (r[key] / r['measured_step_s'] - 1):+.1f}%"
    for r in rows:
        none = next(x for x in rows if x["model"] == r["model"] and x["remat"] == "none")
        m = r["non_gemm_bytes"]
        lines.append(f"| {r['model']} | {r['remat']} | {m['forward'] / 1e9:.1f} | {m['backward'] / 1e9:.1f} | "
                     f"{m['outside'] / 1e9:.1f} | {gb(r):.1f} | {gb(r) - gb(none):+.1f} | {r['model_step_s']:.4f} | "
                     f"{error(r, 'model_step_s')} | {r['model_cpu_layers_step_s']:.4f} | "
                     f"{error(r, 'model_cpu_layers_step_s')} | "
                     f"{r['program_step_s']:.4f} | {error(r, 'program_step_s')} | "
                     f"{r['measured_step_s']:.4f} |")
    spread = lambda key: {m: max(e) - min(e) for m in dict.fromkeys(r["model"] for r in rows) for e in [
        [100 * (r[key] / r["measured_step_s"] - 1) for r in rows if r["model"] == m]]}
    worst = lambda key: max(abs(100 * (r[key] / r["measured_step_s"] - 1)) for r in rows)
    lines += ["", f"Largest |error|: the model {worst('model_step_s'):.1f}% (with XLA:CPU's layers, no --target: "
              f"{worst('model_cpu_layers_step_s'):.1f}%), the program {worst('program_step_s'):.1f}%. "
              "Spread of the errors over the four policies (max − min, percentage points): the model "
              + ", ".join(f"{m} {v:.1f}" for m, v in spread("model_step_s").items()) + " (CPU layers "
              + ", ".join(f"{m} {v:.1f}" for m, v in spread("model_cpu_layers_step_s").items()) + "); the program "
              + ", ".join(f"{m} {v:.1f}" for m, v in spread("program_step_s").items()) + "."]
    return "\n".join(lines) + "\n"


def table(rows: list[dict], target: str, jax_version: str) -> str:
    lines = ["# The plan against the H100's measured peaks (`python experiments/gpu_target.py`)", "",
             f"Measured: one H100 80GB HBM3, JAX 0.11.2, bf16, cuDNN attention (called as it is, before "
             f"models/cudnn_attention.py), micro-batch 4 × 2048 tokens "
             f"({MEASURED.relative_to(ROOT)}). `--target {target}`: the whole donated train step compiled for the "
             f"{target.upper()} on this CPU-only machine with jax {jax_version} and its CUDA plugin (argument + "
             f"output + temp − "
             f"alias; the larger of its programs with Triton's and cuBLAS's GEMMs, `gpu_target.step_bytes`). CPU "
             f"plan: `plan` without --target (XLA:CPU, simulated devices). MiB per device.", "",
             "| model | remat | measured | --target h100 | error | CPU plan | error | search --target | error "
             "| search (CPU) | error |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = [f"{r[f'{c}_bytes'] / MIB:,.0f} | {100 * r[f'{c}_error']:+.1f}%"
                 for c in ("target", "cpu_plan", "search_target", "search_cpu")]
        lines.append(f"| {r['model']} | {r['remat']} | {r['measured_bytes'] / MIB:,.0f} | " + " | ".join(cells) + " |")
    worst = max(abs(r["target_error"]) for r in rows)
    lines += ["", f"Largest |error| of --target {target}: {100 * worst:.1f}%; of the CPU plan: "
              f"{100 * max(abs(r['cpu_plan_error']) for r in rows):.1f}%; of the search --target: "
              f"{100 * max(abs(r['search_target_error']) for r in rows):.1f}%. The search (`plan --search`, this "
              "one-GPU "
              "configuration) adds its parts up (the state's share of the peak, `memory.State.at_peak`: the compute "
              "copy's gradients in bf16 where the float32 ones are not made yet; + stored × layers + working), its "
              "layers compiled for the GPU "
              "(--target) or by XLA:CPU; with --target it then holds its best configurations to their whole train "
              "steps compiled for the GPU (`--verify`, 3 by default), here the program of the --target column."]
    return "\n".join(lines) + "\n"


def main() -> int:
    from jaxseq.planning import gpu_target

    gpu_target.cpu_only()
    import jax

    rows, remat = compare(), remat_on_gpu()
    for r in remat:  # the search's time with its layers compiled by XLA:CPU (no --target), + the measured replay
        row = next(x for x in rows if (x["model"], x["remat"]) == (r["model"], r["remat"]))
        r["model_cpu_layers_step_s"] = row["search_cpu_s"] + r["replayed_attention_s"]
    later = later_shapes()
    out = {"jax_version": jax.__version__, "target": "h100", "units": "bytes per device, TFLOP per step, seconds",
           "rows": rows, "remat": remat, "later_shapes": later}
    (RESULTS / "gpu_target_vs_measured.json").write_text(json.dumps(out, indent=1) + "\n")
    text = table(rows, "h100", jax.__version__) + "\n" + remat_table(remat) + "\n" + later_table(later)
    (RESULTS / "gpu_target_vs_measured.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
