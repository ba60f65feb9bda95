"""Does `--fp8` train as well as bf16? The same run with and without it, emulated on the CPU (issue 57).

    python experiments/fp8_convergence.py                  # both pairs, one run after another
    python experiments/fp8_convergence.py default          # one pair, by label (the others' results are kept)
    python experiments/fp8_convergence.py --together gpt2-124m   # its two runs at once (what results/ holds)
    python experiments/fp8_convergence.py default --seeds 0,1,2  # the default pair at three seeds, and its mean gap

Each pair is one `python -m jaxseq.train` command run twice as a user types it (a new process, no compilation cache),
once with `--dtype bfloat16` and once with `--dtype bfloat16 --fp8` (`--fp8` refuses float32, so bf16 is the
reference); everything else, the seed and so the data order and initial weights, is the same. On a CPU the FP8
GEMMs run emulated: the same per-tensor scaling and e4m3/e5m2 rounding as on a GPU, the GEMM itself in bf16
(models/fp8.py). The gate is the issue's: the FP8 run's final validation loss within 0.01 nats of the bf16 run's.

- `default`: the default run (README: `python -m jaxseq.train`, preset stdlib-bytes, 800 steps of 32 × 128 bytes,
  data=2 × tensor=4 + SP, selective recompute) in bf16.
- `gpt2-124m`: GPT-2 small's shape (preset gpt2-124m: 12 layers, hidden 768, 12 heads) with the vocabulary of the
  corpus jaxseq trains on by default (the standard library's bytes: 257 ids), on one CPU device (no collectives and
  no recompute), GPT2_SHAPE's 200 steps of 2 × 64 bytes: what fits a session on a shared 2-core machine, where a
  step of this model costs seconds of CPU even at 128 tokens (results/fp8_convergence.md has the wall times).

Writes experiments/results/fp8_convergence.{md,json}: per run the command, its final train and validation loss, the
validation loss at each evaluation, steps, tokens, wall time and the load average before it; per pair the gap.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
GATE_NATS = 0.01  # the issue's: FP8's final validation loss within this of bf16's

# GPT-2 small on one CPU device: sequence length, batch, steps (sized to a shared 2-core CPU), warmup, and the
# cosine decayed over the run (the preset's own decay runs 10,000 steps).
GPT2_SHAPE = {"seq_len": 64, "batch": 2, "steps": 200, "warmup": 20}

# (label, what it is, the train command's arguments after `python -m jaxseq.train`, sequences, tokens a sequence)
PAIRS = [
    ("default", "the default run (README), bf16",
     ["--dtype", "bfloat16"], 32, 128),
    ("gpt2-124m", "GPT-2 small's shape, the default corpus's byte vocabulary, one CPU device",
     ["--preset", "gpt2-124m", "--dtype", "bfloat16", "--host-devices", "1", "--mesh", "data=1,tensor=1",
      "--no-sequence-parallel", "--remat", "none", "--seq-len", str(GPT2_SHAPE["seq_len"]),
      "--batch-size", str(GPT2_SHAPE["batch"]), "--steps", str(GPT2_SHAPE["steps"]),
      "--warmup-steps", str(GPT2_SHAPE["warmup"]), f"optimizer.decay_steps={GPT2_SHAPE['steps']}",
      "--eval-every", "100", "eval_batches=32", "--log-every", "10", "--checkpoint-every", "100000", "sample_tokens=0"],
     GPT2_SHAPE["batch"], GPT2_SHAPE["seq_len"]),
]


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    import jax

    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__}


def train(label: str, argv: list[str], sequences: int, seq_len: int) -> dict:
    """One train command in a fresh process: its final losses from RUN_DIR/metrics.jsonl, wall time and load."""
    load = os.getloadavg()[0]
    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false"}
    with tempfile.TemporaryDirectory() as run_dir:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "jaxseq.train", *argv, "--run-dir", run_dir], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"{label}: exit {done.returncode}\n{done.stderr[-3000:]}")
        records = [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]
    last = max((r for r in records if "loss" in r), key=lambda r: r["step"])
    evaluated = [r for r in records if "val_loss" in r]
    return {"label": label, "command": "python -m jaxseq.train " + " ".join(argv),
            "steps": last["step"], "tokens": last["step"] * sequences * seq_len,
            "train_loss": round(last["loss"], 4), "val_loss": round(evaluated[-1]["val_loss"], 4),
            "val_curve": {r["step"]: round(r["val_loss"], 4) for r in evaluated},
            "wall_s": round(wall, 1), "load_before": round(load, 2)}


def _duration(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes} min {s} s" if minutes else f"{s} s"


def pair_row(pair: dict) -> str:
    bf16, fp8 = pair["bf16"], pair["fp8"]
    verdict = "within" if abs(pair["gap_nats"]) <= GATE_NATS else "**outside**"
    return (f"| {pair['label']} | {bf16['steps']} | {bf16['tokens']:,} | {bf16['train_loss']:.4f} / "
            f"{fp8['train_loss']:.4f} | {bf16['val_loss']:.4f} | {fp8['val_loss']:.4f} | {pair['gap_nats']:+.4f} "
            f"({verdict} {GATE_NATS}) | {_duration(bf16['wall_s'])} / {_duration(fp8['wall_s'])} | "
            f"{bf16['load_before']} / {fp8['load_before']} |")


def seed_summary(ordered: list[dict]) -> list[str]:
    """Per pair run at several seeds: the mean gap, and how far bf16's own validation loss moves with the seed (the
    noise a single pair's gap sits in)."""
    lines = []
    for label in dict.fromkeys(p.get("pair", p["label"]) for p in ordered):
        runs = [p for p in ordered if p.get("pair", p["label"]) == label]
        if len(runs) < 2:
            continue
        gaps, bf16 = [p["gap_nats"] for p in runs], [p["bf16"]["val_loss"] for p in runs]
        mean = sum(gaps) / len(gaps)
        verdict = "within" if abs(mean) <= GATE_NATS else "**outside**"
        lines.append(f"\n{label} over seeds {', '.join(str(p.get('seed', 0)) for p in runs)}: mean gap "
                     f"{mean:+.4f} nats ({verdict} {GATE_NATS}), gaps from {min(gaps):+.4f} to {max(gaps):+.4f}; "
                     f"bf16's validation loss itself spans {max(bf16) - min(bf16):.4f} nats across the seeds.")
    return lines


def write(pairs: list[dict], info: dict) -> None:
    path = RESULTS / "fp8_convergence.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    measured = {p["label"]: p for p in old.get("pairs", [])} | {p["label"]: p for p in pairs}
    rank = {label: i for i, (label, *_) in enumerate(PAIRS)}
    ordered = sorted(measured.values(), key=lambda p: (rank[p.get("pair", p["label"])], p.get("seed", 0)))
    path.write_text(json.dumps({"machine": info, "gate_nats": GATE_NATS, "pairs": ordered}, indent=1) + "\n")
    lines = ["# FP8 against bf16, emulated on the CPU (`python experiments/fp8_convergence.py`)", "",
             f"Machine: {info['cpu']}, {info['cores']} cores (shared with other jobs: see the load), Python "
             f"{info['python']}, JAX {info['jax']}, measured {info['date']}. Each pair is one train command run "
             "with `--dtype bfloat16` and again with `--fp8` added; the same seed, data order and initial weights. "
             "Losses in nats per token (here a byte); gap: FP8's final validation loss minus bf16's; load: the "
             "1-minute load average before the run started.", "",
             "| pair | steps | tokens | final train loss, bf16 / FP8 | validation loss, bf16 | validation loss, FP8 "
             "| gap, nats | wall, bf16 / FP8 | load before |", "|" + " --- |" * 9]
    lines += [pair_row(p) for p in ordered]
    lines += seed_summary(ordered)
    lines += ["", "Validation loss at each evaluation (step: bf16 / FP8):", ""]
    for p in ordered:
        curve = ", ".join(f"{step}: {loss:.4f} / {p['fp8']['val_curve'][step]:.4f}"
                          for step, loss in p["bf16"]["val_curve"].items())
        lines.append(f"- {p['label']}: {curve}")
    lines += ["", "Commands:", ""]
    for p in ordered:
        when = "at the same time" if p.get("together") else "one after the other"
        lines += [f"- {p['label']} ({p['what']}): `{p['bf16']['command']}`, and the same with `--fp8`, {when}"]
    (RESULTS / "fp8_convergence.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("labels", nargs="*", help=f"which pairs (default: all): {', '.join(p[0] for p in PAIRS)}")
    parser.add_argument("--seeds", default="0",
                        help="comma-separated seeds (default 0, the command's own); another seed is the same command "
                             "with `seed=N` appended (other initial weights and data order), its pair labelled "
                             "'LABEL, seed N'")
    parser.add_argument("--together", action="store_true",
                        help="run each pair's bf16 and FP8 commands at the same time (a busy machine: the two share "
                             "its load, and the pair ends in about one run's wall time when other jobs hold the rest)")
    args = parser.parse_args(argv)
    unknown = set(args.labels) - {p[0] for p in PAIRS}
    if unknown:
        parser.error(f"unknown pairs {sorted(unknown)}; valid: {', '.join(p[0] for p in PAIRS)}")
    info = {**machine(), "date": datetime.date.today().isoformat()}
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds={args.seeds!r}: expected comma-separated integers, e.g. 0,1,2")
    done = []
    for (label, what, base, sequences, seq_len), seed in itertools.product(PAIRS, seeds):
        if args.labels and label not in args.labels:
            continue
        command = base + ([f"seed={seed}"] if seed else [])
        pair_label = f"{label}, seed {seed}" if seed else label
        with ThreadPoolExecutor(max_workers=2 if args.together else 1) as pool:
            futures = {name: pool.submit(train, f"{pair_label} {name}", command + extra, sequences, seq_len)
                       for name, extra in (("bf16", []), ("fp8", ["--fp8"]))}
            runs = {name: future.result() for name, future in futures.items()}
        for name, r in runs.items():
            print(f"{pair_label} {name}: validation loss {r['val_loss']:.4f} nats after {r['steps']} steps, "
                  f"{_duration(r['wall_s'])} (load before {r['load_before']})", flush=True)
        done.append({"label": pair_label, "pair": label, "seed": seed, "what": what, "together": args.together, **runs,
                     "gap_nats": round(runs["fp8"]["val_loss"] - runs["bf16"]["val_loss"], 4)})
        print(f"{pair_label}: FP8 − bf16 = {done[-1]['gap_nats']:+.4f} nats", flush=True)
        write(done, info)


if __name__ == "__main__":
    main()
