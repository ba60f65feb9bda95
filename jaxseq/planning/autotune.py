"""A GPU's own GEMM choices, compiled offline: the plan's train step as the device compiled it.

Without a device XLA cannot autotune, so `plan --target` takes the larger of the all-Triton and all-cuBLAS programs
(planning/gpu_target.py). A GPU run can record what its autotuner chose (`xla_gpu_dump_autotune_results_to`:
`jaxseq.train --record-autotune FILE`, experiments/gpu.py), and a compile for the target can load it
(`xla_gpu_load_autotune_results_from`): XLA looks each fusion up by its HLO's fingerprint and the device's
description, and takes the device's choice where it finds one. A step is the device's program only where every
one of its GEMMs finds its choice: XLA makes a GEMM it finds none for a Triton fusion, which may hold more or less
than the device's (JAX 0.12 finds few of gpt3-1.3b's GEMMs at micro-batch 32 in JAX 0.11.2's file, and that
program is 12% under the peak). So the step compiles first with XLA asked to refuse any fusion it finds no choice
for, and XLA's log names those fusions, each with its HLO. Where only fusions other than GEMMs lack a choice (10 of
the optimizer update's in every H100 step here), it compiles again without the refusal and leaves those to XLA's
default. A GEMM is told by its HLO (a dot, a GEMM backend), not by the name XLA gave its fusion; a fusion that cannot
be told from one (its body not in the log, or fewer named than XLA counted) is one line, never XLA's default
passed off as the device's choice (`without_a_choice`). How
closely it reproduces a GPU's measured peaks: experiments/results/autotune_replay_jax0.11.2.md.

Three facts about XLA shape this module:
- XLA loads such a file once per process and keeps its choices for every later compile. So each step compiles with
  its file in a process of its own (`main`), and the planning process's own compiles keep XLA's defaults.
- A cuBLAS choice carries the CUDA build of the XLA that made it ("13.0.0"), and an XLA of another build ("12.9.0")
  skips it, so the file is relabelled with this plugin's build (`relabelled`). A plan reads buffers, which follow the
  choice of cuBLAS or Triton; the cuBLAS algorithm within that choice only sizes a workspace.
- Only the XLA that wrote a file finds all of a step's fusions in it. JAX 0.12 finds no choice for 3 to 10 of each
  gpt3-1.3b step's GEMMs in 0.11.2's files, and JAX 0.10's XLA cannot read the format at all.

The autotuner times its candidates, so a close call can go either way from one run to the next. The same GEMM took
cuBLAS in one 2026-11-27 run and Triton in another. A file therefore holds one run's choices.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxseq.config import ConfigError, ModelConfig, ParallelConfig
from jaxseq.planning.hlo import CUBLAS

LOAD = "xla_gpu_load_autotune_results_from"
COMPLETE = "xla_gpu_require_complete_aot_autotune_results"  # a fusion without a recorded choice: NOT_FOUND, logged
# XLA's log entry for each such fusion: its HLO with the fused computation's body (XLA prints it with
# kFullBodies), then the status.
MISSING = re.compile(r"Could not get config for HLO: %(?P<name>[^\s=]+) = (?P<hlo>.*?)\. Status: ", re.S)
FAILURES = re.compile(r"Failed to get configs for: (\d+) out of")  # XLA's count, where more than one failed
GEMM_FUSION = re.compile(r"^(gemm_fusion|cublas|triton_gemm)")  # XLA:GPU's names for a GEMM's fusion
GEMM_HLO = re.compile(r"\bdot\(|__triton_gemm|__cublas|__cudnn")  # what a GEMM's HLO holds, whatever its name
CUDA_BUILD_VERSION = re.compile(r'(optimal_backend_version: )"\d+\.\d+\.\d+"')  # a cuBLAS choice's CUDA build
CUBLAS_CHOICE = re.compile(r"backend: CUBLAS")
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


class RecordedGemms:
    """The autotuner's choices that one GPU run recorded (XLA's AutotuneResults, text), relabelled so that this JAX's
    XLA:GPU takes its cuBLAS choices (`relabelled`), in a file of its own that lives as long as this object."""

    def __init__(self, path: str):
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--autotune-results {path}: cannot be read ({type(e).__name__}); give the text file "
                              f"that `jaxseq.train --record-autotune` (xla_gpu_dump_autotune_results_to) "
                              f"wrote on a GPU") from None
        if "entries {" not in text and "results {" not in text:
            raise ConfigError(f"--autotune-results {path}: holds no autotune results (no `entries {{`); give the text "
                              f"file that `jaxseq.train --record-autotune` (xla_gpu_dump_autotune_results_to) "
                              f"wrote on a GPU")
        self.source, self.cublas_choices = path, len(CUBLAS_CHOICE.findall(text))
        self._dir = tempfile.TemporaryDirectory(prefix="jaxseq-autotune-")
        self.path = str(Path(self._dir.name) / "autotune.textproto")
        Path(self.path).write_text(relabelled(text, cuda_build_version()))


def relabelled(text: str, version: str) -> str:
    """`text` with its cuBLAS choices labelled CUDA `version`; other choices unchanged (a cuDNN choice carries
    cuDNN's)."""
    entries = text.split("entries {")
    return "entries {".join(CUDA_BUILD_VERSION.sub(rf'\1"{version}"', e) if CUBLAS_CHOICE.search(e) else e
                            for e in entries)


def cuda_build_version() -> str:
    """This CUDA plugin's build as XLA labels its cuBLAS choices: 12090 → "12.9.0"."""
    from jax._src.lib import cuda_versions  # the plugin's own; JAX has no public name for it

    if cuda_versions is None:
        from jaxseq.planning.gpu_target import INSTALL

        raise ConfigError(f"--autotune-results needs JAX's CUDA plugin: {INSTALL}")
    v = cuda_versions.cuda_runtime_build_version()
    return f"{v // 1000}.{v % 1000 // 10}.{v % 10}"


def step_bytes(cfg: ModelConfig, parallel: ParallelConfig, remat: str, micro_batch: int, microbatches: int,
               target: str, recorded: RecordedGemms) -> int | None:
    """The step's peak bytes per device compiled for `target` with the `recorded` choices; None where the file lacks a
    choice for any of the step's GEMMs (another model, shape, policy, mesh, GPU or XLA recorded it)."""
    return replay(cfg, parallel, remat, micro_batch, microbatches, target, recorded)["bytes"]


def replay(cfg: ModelConfig, parallel: ParallelConfig, remat: str, micro_batch: int, microbatches: int,
           target: str, recorded: RecordedGemms) -> dict:
    """The step compiled for `target` with the `recorded` choices in a process of its own (`main`): its bytes (None
    where a GEMM found no choice), the fusions that found none and the GEMMs among them, and its cuBLAS GEMMs; one
    line where a fusion without a choice cannot be told from a GEMM (`without_a_choice`)."""
    request = {"model": dataclasses.asdict(cfg), "parallel": dataclasses.asdict(parallel), "remat": remat,
               "micro_batch": micro_batch, "microbatches": microbatches, "target": target, "file": recorded.path}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")])),
               TF_CPP_MIN_LOG_LEVEL="0")  # XLA's log names the fusions without a choice
    proc = subprocess.run([sys.executable, "-m", "jaxseq.planning.autotune", json.dumps(request)],
                          capture_output=True, text=True, env=env)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("{")), None)
    if proc.returncode or line is None:
        error = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        if "autotune results" in error:  # e.g. "Failed to parse autotune results string."
            import jax

            raise ConfigError(f"--autotune-results {recorded.source}: this JAX's XLA ({jax.__version__}) cannot read "
                              f"it ({error[-120:]}); plan with the JAX that recorded it "
                              f"(XLA:GPU's files from JAX 0.11 on)")
        raise ConfigError(f"--autotune-results {recorded.source}: the step did not compile with it ({error[-200:]})")
    result = json.loads(line)
    if "error" in result:  # a fusion without a choice that cannot be told from a GEMM (`without_a_choice`)
        raise ConfigError(f"--autotune-results {recorded.source}: {result['error']}")
    return result


def cublas_gemms(hlo_text: str) -> int:
    """The GEMMs a compiled XLA:GPU program hands to cuBLAS (its `__cublas$…` custom calls)."""
    return hlo_text.count(f'custom_call_target="{CUBLAS}')


def compile_logged(compile_step, options: dict):
    """`compile_step(options)` with this process's fd 2 (where XLA logs) caught: (the program or None where XLA
    raised NOT_FOUND for a fusion without a choice, the log)."""
    import jax

    with tempfile.TemporaryFile() as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            compiled = compile_step(options)
        except jax.errors.JaxRuntimeError as e:
            if "NOT_FOUND" not in str(e):
                raise
            compiled = None
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        return compiled, log.read().decode(errors="replace")


def without_a_choice(log: str, refused: bool) -> tuple[list[str], list[str]]:
    """(the GEMMs, the other fusions) that XLA's `log` names as finding no recorded choice; `refused`: XLA refused
    the compile for one (NOT_FOUND). A GEMM is told by its HLO (a dot, or a cuBLAS, Triton-GEMM or cuDNN backend),
    whatever XLA named its fusion; one the log shows without its fused body is a GEMM by name or cannot be placed.
    What cannot be placed (that fusion, or a refusal the log names too few fusions for) is one line, a ConfigError:
    compiled anyway, XLA's default for a GEMM would be passed off as the device's choice."""
    gemms, others = [], []
    for entry in MISSING.finditer(log):
        name, hlo = entry["name"], entry["hlo"]
        if GEMM_HLO.search(hlo) or GEMM_FUSION.match(name):
            gemms.append(name)
        elif "ROOT " in hlo:  # its fused body, holding no GEMM
            others.append(name)
        else:
            raise ConfigError(f"XLA found no recorded choice for {name} and its log does not show what the fusion "
                              "computes, so it cannot be told from a GEMM; the step is not compiled with XLA's default "
                              "in its place")
    counted = [int(n) for n in FAILURES.findall(log)]
    named = len(gemms) + len(others)
    if refused and (named == 0 or any(n > named for n in counted)):
        what = f"{max(counted)} fusions" if counted else "a fusion"
        raise ConfigError(f"XLA found no recorded choice for {what} and its log names {named}: the others cannot be "
                          "told from GEMMs; the step is not compiled with XLA's default in their place")
    return gemms, others


def main(argv: list[str]) -> int:
    """The child: one step compiled with one file of choices (`step_bytes`'s request): one line of JSON, its bytes
    (null where a GEMM found no choice), the fusions that found none and the GEMMs among them, and its cuBLAS GEMMs;
    or the error where one cannot be told from a GEMM."""
    from jaxseq.planning import gpu_target

    gpu_target.cpu_only()
    from jaxseq.training import aot

    r = json.loads(argv[0])
    step = lambda options: gpu_target.compile_step(ModelConfig(**r["model"]), ParallelConfig(**r["parallel"]),
                                                   r["remat"], r["micro_batch"], r["microbatches"], r["target"],
                                                   options=options)
    compiled, log = compile_logged(step, {LOAD: r["file"], COMPLETE: True})
    try:
        gemms, others = without_a_choice(log, refused=compiled is None)
    except ConfigError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return 0
    complete = compiled is not None or not gemms
    if compiled is None and complete:  # only fusions beside the GEMMs lack a choice: XLA's default for those
        compiled = step({LOAD: r["file"]})
    print(json.dumps({"bytes": aot.step_bytes(compiled) if complete else None, "missing": gemms + others,
                      "gemms": gemms, "cublas_gemms": cublas_gemms(compiled.as_text()) if complete else None}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
