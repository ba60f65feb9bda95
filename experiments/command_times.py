"""How long the documented commands take: the one measured source the docs quote for each command's time.

    python experiments/command_times.py                  # every command below, one after another (about 25 min)
    python experiments/command_times.py default-run      # one of them, by label

Each command runs as a user types it (a new process, the project's own flags, no test flags), into a temporary run
directory; its wall time, its CPU time (user + system of the process and its children) and the machine (CPU model,
cores, load average before it started) go to experiments/results/command_times.{json,md}. A figure measured on a
busy machine says so (its load average), and is not what an idle machine takes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"

# (label, where the docs quote it, the command's arguments after `python -m`); RUN_DIR is a fresh temporary directory.
COMMANDS = [
    ("default-run", "README.md (Training and sampling), docs/training.md (Measured)",
     ["jaxseq.train", "--run-dir", "RUN_DIR"]),
    ("plan-llama3-8b-128k", "README.md (Context parallelism)",
     ["jaxseq.plan", "--preset", "llama3-8b", "--seq-len", "131072", "--tensor", "8", "--context", "8",
      "--context-strategy", "ring", "--budget-gib", "80"]),
    ("search-tiny", "docs/planning.md (the search's commands)",
     ["jaxseq.plan", "--search", "--preset", "tiny", "--gpus", "16", "--global-batch", "32", "--gpus-per-node", "4",
      "--remat-policies", "full", "--micro-batch-sizes", "1", "--context-sizes", "1"]),
    ("search-gpt3-175b", "README.md (Planning), docs/planning.md",
     ["jaxseq.plan", "--search", "--preset", "gpt3-175b", "--gpus", "1024", "--gpu-memory-gib", "80",
      "--global-batch", "1536", "--context-sizes", "1"]),
    ("search-llama3-8b-fsdp", "docs/planning.md (FSDP)",
     ["jaxseq.plan", "--search", "--preset", "llama3-8b", "--gpus", "8", "--global-batch", "32", "--hardware", "h100",
      "--context-sizes", "1", "--fsdp-sizes", "1,8", "--tensor-sizes", "1,8", "--remat-policies", "selective,full",
      "--micro-batch-sizes", "1,2,4"]),
]


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version()}


def run(label: str, argv: list[str]) -> dict:
    """One command's wall and CPU seconds (itself and its children), and the load average before it."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as run_dir:
        args = [sys.executable, "-m", *(run_dir if a == "RUN_DIR" else a for a in argv)]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{label}: exit {done.returncode}\n{done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"label": label, "command": "python -m " + " ".join(argv).replace("RUN_DIR", "runs/…"),
            "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "load_before": round(load, 2)}


def _duration(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes} min {s} s" if minutes else f"{s} s"


def write(rows: list[dict], info: dict) -> None:
    old = json.loads((RESULTS / "command_times.json").read_text()) if (RESULTS / "command_times.json").exists() else {}
    measured = {r["label"]: r for r in old.get("rows", [])} | {r["label"]: r for r in rows}
    ordered = [measured[label] for label, _, _ in COMMANDS if label in measured]
    (RESULTS / "command_times.json").write_text(json.dumps({"machine": info, "rows": ordered}, indent=1) + "\n")
    lines = ["# How long the documented commands take (`python experiments/command_times.py`)", "",
             f"Machine: {info['cpu']}, {info['cores']} cores, Python {info['python']}, measured {info['date']}. Wall "
             "time of the command as typed (a new process, its own compiles, no compilation cache); CPU: user + "
             "system seconds of the process and its children; load: the 1-minute load average before it started "
             "(about 0 on an idle machine).", "",
             "| command | wall | CPU | load before | quoted in |", "| --- | --- | --- | --- | --- |"]
    where = {label: doc for label, doc, _ in COMMANDS}
    lines += [f"| `{r['command']}` | {_duration(r['wall_s'])} | {_duration(r['cpu_s'])} | {r['load_before']} | "
              f"{where[r['label']]} |" for r in ordered]
    (RESULTS / "command_times.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("labels", nargs="*", help=f"which to run (default: all): {', '.join(c[0] for c in COMMANDS)}")
    args = parser.parse_args(argv)
    unknown = set(args.labels) - {c[0] for c in COMMANDS}
    if unknown:
        parser.error(f"unknown labels {sorted(unknown)}; valid: {', '.join(c[0] for c in COMMANDS)}")
    info = {**machine(), "date": datetime.date.today().isoformat()}
    rows = []
    for label, _, command in COMMANDS:
        if not args.labels or label in args.labels:
            rows.append(run(label, command))
            print(f"{label}: {_duration(rows[-1]['wall_s'])} (load before {rows[-1]['load_before']})", flush=True)
            write(rows, info)


if __name__ == "__main__":
    main()
