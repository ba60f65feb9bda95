"""A GPU's own GEMM choices, compiled offline: the plan's train step as the device compiled it.

Without a device XLA cannot autotune, so `plan --target` takes the larger of the all-Triton and all-cuBLAS programs
(planning/gpu_target.py). A GPU run can record what its autotuner chose (`xla_gpu_dump_autotune_results_to`:
`jaxseq.train --record-autotune FILE`, experiments/gpu.py), and a compile for the target can load it
(`xla_gpu_load_autotune_results_from`): XLA looks each fusion up by its HLO's fingerprint and the device's
description, and takes the device's choice where it finds one. On an H100 this reproduced each of ten measured peaks
within 0.13%, most of them to the byte (experiments/results/autotune_replay.md).

Three facts about XLA shape this module:
- XLA loads such a file once per process and keeps its choices for every later compile. So each step compiles with
  its file in a process of its own (`main`), and the planning process's own compiles keep XLA's defaults.
- A cuBLAS choice carries the CUDA build of the XLA that made it ("13.0.0"), and an XLA of another build ("12.9.0")
  skips it, so the file is relabelled with this plugin's build (`relabelled`). A plan reads buffers, which follow the
  choice of cuBLAS or Triton; the cuBLAS algorithm within that choice only sizes a workspace.
- JAX 0.10's XLA cannot read the format that JAX 0.11's writes.

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

LOAD = "xla_gpu_load_autotune_results_from"
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
            raise ConfigError(f"--autotune-results {path}: cannot be read ({type(e).__name__}); give the text file that "
                              f"`jaxseq.train --record-autotune` (xla_gpu_dump_autotune_results_to) wrote on a GPU") from None
        if "entries {" not in text and "results {" not in text:
            raise ConfigError(f"--autotune-results {path}: holds no autotune results (no `entries {{`); give the text "
                              f"file that `jaxseq.train --record-autotune` (xla_gpu_dump_autotune_results_to) wrote on a GPU")
        self.source, self.cublas_choices = path, len(CUBLAS_CHOICE.findall(text))
        self._dir = tempfile.TemporaryDirectory(prefix="jaxseq-autotune-")
        self.path = str(Path(self._dir.name) / "autotune.textproto")
        Path(self.path).write_text(relabelled(text, cuda_build_version()))


def relabelled(text: str, version: str) -> str:
    """`text` with its cuBLAS choices labelled CUDA `version`; other choices unchanged (a cuDNN choice carries cuDNN's)."""
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
    """The step's peak bytes per device compiled for `target` with the `recorded` choices, in a process of its own;
    None where the file holds none of this step's GEMMs: it holds cuBLAS choices and the program calls no cuBLAS GEMM
    (another model, shape, policy, mesh, GPU or XLA recorded it; XLA makes each GEMM it has no choice for a Triton
    fusion)."""
    request = {"model": dataclasses.asdict(cfg), "parallel": dataclasses.asdict(parallel), "remat": remat,
               "micro_batch": micro_batch, "microbatches": microbatches, "target": target, "file": recorded.path}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "jaxseq.planning.autotune", json.dumps(request)],
                          capture_output=True, text=True, env=env)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("{")), None)
    if proc.returncode or line is None:
        error = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        if "autotune results" in error:  # e.g. "Failed to parse autotune results string."
            import jax

            raise ConfigError(f"--autotune-results {recorded.source}: this JAX's XLA ({jax.__version__}) cannot read it "
                              f"({error[-120:]}); XLA:GPU's files from JAX 0.11 on need JAX >= 0.11 here too")
        raise ConfigError(f"--autotune-results {recorded.source}: the step did not compile with it ({error[-200:]})")
    out = json.loads(line)
    return None if recorded.cublas_choices and not out["cublas_gemms"] else out["bytes"]


def cublas_gemms(hlo_text: str) -> int:
    """The GEMMs a compiled XLA:GPU program hands to cuBLAS (its `__cublas$…` custom calls)."""
    return len(re.findall(r'custom_call_target="__cublas', hlo_text))


def main(argv: list[str]) -> int:
    """The child: one step compiled with one file of choices (`step_bytes`'s request), its bytes and cuBLAS GEMMs
    printed as one line of JSON."""
    from jaxseq.planning import gpu_target

    gpu_target.cpu_only()
    from jaxseq.training import aot

    r = json.loads(argv[0])
    compiled = gpu_target.compile_step(ModelConfig(**r["model"]), ParallelConfig(**r["parallel"]), r["remat"],
                                       r["micro_batch"], r["microbatches"], r["target"], options={LOAD: r["file"]})
    print(json.dumps({"bytes": aot.step_bytes(compiled), "cublas_gemms": cublas_gemms(compiled.as_text())}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
