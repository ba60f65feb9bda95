"""Peak memory and speed of `python -m jaxseq.data` on a 20 MB and a 200 MB corpus, before and after it
streamed (issue 22, item 8).

    python experiments/data_memory.py      # writes experiments/results/data_memory.{md,json}

1. Assembles two corpora of Python source from the running interpreter's standard library (its top-level
   .py files, copied into part000/, part001/, … until the size is reached; the split by file name puts
   every copy of a file on the same side), and each corpus as one file (the files concatenated).
2. Runs the command on each, as a user would, in a child process whose peak resident set size the kernel
   reports (`os.wait4`: ru_maxrss): bytes (no tokenizer), `--tokenizer` (a BPE of 8192 ids trained once on
   the 20 MB corpus) and `--vocab-size 8192` (training the BPE on the corpus, then tokenizing). "before"
   is the code at 14ed963 (`git archive`), "after" this checkout. One file is run in the first two
   modes (`--vocab-size` trains the same BPE either way); the old code with `--tokenizer` on the 200 MB
   file is left out: it holds the whole file's encoding twice, more than a shared machine should be
   asked for (the 20 MB file shows how it grows). `--vocab-size` on 200 MB is left out for time: its
   tokenizing half is the `--tokenizer` row, and training the BPE is tokenizers' trainer either way.
3. Tokens per second: the tokens written (PREFIX.json) over the command's wall time, start-up included.
   A run still going after LIMIT_S is stopped; its row gives the peak RSS reached until then.
Each row is kept in WORK/rows.json as it is measured (a second invocation measures only what is missing),
and the report is rewritten after each row.
"""

from __future__ import annotations

import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
WORK = Path("/tmp/jaxseq-data-memory")
BEFORE = "14ed963"
SIZES = {"20 MB": 20_000_000, "200 MB": 200_000_000}
VOCAB = "8192"
LIMIT_S = 900  # a run still going after this is stopped (and reported as such)


def corpus(name: str, size: int) -> tuple[Path, Path]:
    """A directory of stdlib copies of at least `size` bytes, and the same text as one file."""
    import sysconfig

    directory, single = WORK / f"corpus-{size}", WORK / f"corpus-{size}.txt"
    if single.exists() and single.stat().st_size >= size:
        return directory, single
    shutil.rmtree(directory, ignore_errors=True)
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    total, part = 0, 0
    with open(single, "wb") as whole:
        while total < size:
            target = directory / f"part{part:03d}"
            target.mkdir(parents=True)
            for source in sources:
                data = source.read_bytes()
                (target / source.name).write_bytes(data)
                whole.write(data)
                total += len(data)
                if total >= size:
                    break
            part += 1
    return directory, single


def old_checkout() -> Path:
    """The jaxseq package at BEFORE, for PYTHONPATH."""
    target = WORK / f"jaxseq-{BEFORE}"
    if not target.exists():
        archive = subprocess.run(["git", "archive", BEFORE, "jaxseq"], cwd=ROOT, capture_output=True, check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(target, filter="data")
    return target


def measure(code: Path, args: list[str], prefix: Path) -> dict:
    """One run of the command: peak RSS (MiB, the kernel's ru_maxrss of the child), wall seconds, tokens."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    start = time.perf_counter()
    with open(f"{prefix}.out", "wb") as out, open(f"{prefix}.err", "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "jaxseq.data", *args, "--output", str(prefix)], cwd=WORK,
                                env=env, stdout=out, stderr=err)
        status, usage = _wait(proc)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if proc.returncode == -9:  # stopped at LIMIT_S
        return {"peak_rss_mib": round(usage.ru_maxrss / 1024, 1), "wall_s": round(wall, 2), "stopped": True}
    if proc.returncode != 0:
        raise RuntimeError(f"{args} failed: {Path(f'{prefix}.err').read_text()[-2000:]}")
    meta = json.loads(Path(f"{prefix}.json").read_text())
    printed = Path(f"{prefix}.out").read_text().strip()
    for suffix in (".train.bin", ".val.bin", ".json", ".tokenizer.json", ".out", ".err"):
        Path(f"{prefix}{suffix}").unlink(missing_ok=True)
    tokens = meta["train_tokens"] + meta["val_tokens"]
    return {"peak_rss_mib": round(usage.ru_maxrss / 1024, 1), "wall_s": round(wall, 2), "tokens": tokens,
            "tokens_per_s": round(tokens / wall), "vocab": meta["vocab_size"], "separator": meta.get("eod_token"),
            "printed": printed}


def _wait(proc: subprocess.Popen):
    """(exit status, resource usage) of the child, reaped here; killed (SIGKILL) after LIMIT_S."""
    deadline = time.perf_counter() + LIMIT_S
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            return status, usage
        if time.perf_counter() > deadline:
            proc.kill()
            return os.wait4(proc.pid, 0)[1:]
        time.sleep(0.2)


def runs(old: Path, tokenizer: Path, baseline: float) -> list[dict]:
    """Every (corpus, layout, mode, version) measured, in a fixed order."""
    modes = {"bytes": [], "--tokenizer": ["--tokenizer", str(tokenizer)], "--vocab-size": ["--vocab-size", VOCAB]}
    cache = WORK / "rows.json"
    results = json.loads(cache.read_text()) if cache.exists() else []
    done = {(r["version"], r["corpus"], r["layout"], r["mode"]) for r in results}
    for size_name, size in SIZES.items():
        directory, single = corpus(size_name, size)
        for layout, source in (("files", directory), ("one file", single)):
            for mode, flags in modes.items():
                for version, code in (("before", old), ("after", ROOT)):
                    if (layout == "one file" and mode == "--vocab-size") or (version, size_name, layout, mode) == (
                            "before", "200 MB", "one file", "--tokenizer") or (size_name, mode) == (
                            "200 MB", "--vocab-size") or (version, size_name, layout, mode) in done:
                        continue  # see the module docstring
                    print(f"{version:6} {size_name:6} {layout:8} {mode:12}", end=" ", flush=True)
                    row = measure(code, ["--input", str(source), *flags], WORK / "out" / "tokens")
                    row.update(version=version, corpus=size_name, corpus_bytes=_bytes(source), layout=layout, mode=mode)
                    print(f"{row['peak_rss_mib']:8.1f} MiB {row['wall_s']:7.1f} s", "stopped" if row.get("stopped")
                          else f"{row['tokens_per_s']:>10,} tokens/s", flush=True)
                    results.append(row)
                    cache.write_text(json.dumps(results, indent=1))
                    write_report(results, baseline)
    return results


def _bytes(source: Path) -> int:
    return source.stat().st_size if source.is_file() else sum(p.stat().st_size for p in source.rglob("*.py"))


def _cell(row: dict | None, key: str, form: str) -> str:
    if row is None:
        return "not run"
    if row.get("stopped") and key != "peak_rss_mib":
        return "stopped"
    return form.format(row[key]) + (" (stopped)" if row.get("stopped") else "")


def write_report(results: list[dict], baseline: float) -> None:
    lines = [
        "# `python -m jaxseq.data`: peak memory before and after streaming (issue 22, item 8)",
        "",
        f"`python experiments/data_memory.py`, {time.strftime('%Y-%m-%d')}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPU cores shared with other jobs (tokens/s depend on their load; memory does not).",
        "Corpora: copies of the standard library's top-level .py files (the split by file name keeps each file's "
        "copies on one side), and the same text as one file. Peak RSS: the kernel's `ru_maxrss` of the command's "
        "process (`os.wait4`), the Python interpreter and its imports included "
        f"(`python -m jaxseq.data --help` alone: {baseline:.0f} MiB). Tokens/s: tokens written over the command's "
        f"wall time, start-up included. Tokenizer: a byte-level BPE of {VOCAB} ids trained on the 20 MB corpus; "
        f"`--vocab-size {VOCAB}` trains one on the corpus itself first. before = {BEFORE}, after = this commit.",
        "",
        "| corpus | layout | mode | before: peak RSS MiB | after: peak RSS MiB | before: tokens/s | after: tokens/s "
        "| tokens after (before) | separator id after |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    keyed = {(r["corpus"], r["layout"], r["mode"], r["version"]): r for r in results}
    for corpus_name in SIZES:
        for layout in ("files", "one file"):
            for mode in ("bytes", "--tokenizer", "--vocab-size"):
                after = keyed.get((corpus_name, layout, mode, "after"))
                if after is None:
                    continue
                before = keyed.get((corpus_name, layout, mode, "before"))
                lines.append(
                    f"| {corpus_name} ({after['corpus_bytes'] / 1e6:.1f} MB) | {layout} | {mode} "
                    f"| {_cell(before, 'peak_rss_mib', '{:.0f}')} | **{_cell(after, 'peak_rss_mib', '{:.0f}')}** "
                    f"| {_cell(before, 'tokens_per_s', '{:,}')} | {_cell(after, 'tokens_per_s', '{:,}')} "
                    f"| {_cell(after, 'tokens', '{:,}')} ({_cell(before, 'tokens', '{:,}')}) "
                    f"| {_cell(after, 'separator', '{}')} |")
    lines += ["", f"not run: see the script's docstring. stopped: still running after {LIMIT_S} s, killed (its peak "
              "RSS is the one reached until then). Every run's figures: `data_memory.json`."]
    (RESULTS / "data_memory.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "data_memory.json").write_text(json.dumps({"baseline_rss_mib": baseline, "runs": results}, indent=1))


def main() -> None:
    (WORK / "out").mkdir(parents=True, exist_ok=True)
    old = old_checkout()
    baseline = subprocess.run([sys.executable, "-c", "import os, resource, subprocess, sys; "
                               "subprocess.run([sys.executable, '-m', 'jaxseq.data', '--help'], capture_output=True); "
                               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)"],
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, check=True)
    tokenizer = WORK / "bpe-8192.json"
    if not tokenizer.exists():
        directory, _ = corpus("20 MB", SIZES["20 MB"])
        subprocess.run([sys.executable, "-m", "jaxseq.data", "--input", str(directory), "--output",
                        str(WORK / "bpe"), "--vocab-size", VOCAB], env={**os.environ, "PYTHONPATH": str(ROOT)},
                       check=True, capture_output=True)
        shutil.move(WORK / "bpe.tokenizer.json", tokenizer)
    write_report(runs(old, tokenizer, float(baseline.stdout)), float(baseline.stdout))


if __name__ == "__main__":
    main()
