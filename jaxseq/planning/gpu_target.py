"""Compiling for a GPU on a machine without one: XLA:GPU's own program, buffers and collectives for an A100,
H100 or H200, from the CPU-only machine a user plans on.

JAX's CUDA plugin (requirements-gpu-target.txt) compiles for a described device without opening one: a
topology of N target devices (`jax.experimental.topologies`) from XLA's description of the card
(`gpu_specs/NAME.txtpb`, a `GpuTargetConfigProto`). A mesh over those devices takes the same shardings as a
real one, so the train step lowers and compiles unchanged, NCCL collectives and cuDNN attention included,
and `memory_analysis()` is XLA:GPU's accounting. Nothing can run on them.

What a missing device costs: XLA cannot autotune. Left alone it makes every GEMM a Triton fusion with default
tiles; on the device the autotuner picks Triton or cuBLAS per GEMM by speed, and the two programs' buffers differ
where a Triton fusion takes in its GEMM's epilogue: gpt3-1.3b's `full` step at micro-batch 32 (the LM head's f32
logits) peaked at 41.2 GiB on an H100, which cuBLAS forced predicts within 0.1% and Triton 14% low; at
micro-batch 4 the two differ by at most 2.6% (experiments/results/gpu_h100_2026-11-27/). So a step's peak
(`step_bytes`) is the larger of both programs' (two compiles), and its time is priced on the Triton program
(`step_costs`), the one the time model was checked on. cuDNN's workspace is not sized (u8[0]; megabytes on the
device).

Where the device's own choices were recorded, the step compiles once with them instead (`planning.autotune`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import jax

from jaxseq.config import ConfigError, ModelConfig, ParallelConfig, on_platform, replace
from jaxseq.mesh import make_mesh
from jaxseq.models import model
from jaxseq.planning import hlo_flops, hlo_kernels, hlo_loops
from jaxseq.planning.measure import MEASURE_LAYERS
from jaxseq.training import aot

TARGETS = ("a100", "h100", "h200")  # gpu_specs/NAME.txtpb: A100 SXM4 80GB, H100 SXM 80GB HBM3, H200 SXM 141GB
SPECS = Path(__file__).parent / "gpu_specs"
INSTALL = "pip install -r requirements-gpu-target.txt"


def cpu_only() -> None:
    """Keep JAX's backends to the CPU, asked for before they start (a command's first lines): the CUDA plugin
    still compiles for a topology, while starting its backend on a machine without a GPU fails (cuInit, error
    303) and takes the plugin down with it. Where the backends already run (in-process, the tests), nothing."""
    try:
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:
        pass


def target_config(target: str) -> str:
    if target not in TARGETS:
        raise ConfigError(f"target={target!r} is not a known GPU; valid: {', '.join(TARGETS)}")
    return (SPECS / f"{target}.txtpb").read_text()


def target_of(device_kind: str) -> str | None:
    """The target whose description is of the GPU JAX names `device_kind` (its `device_description_str`), if any."""
    return next((t for t in TARGETS if f'device_description_str: "{device_kind}"' in target_config(t)), None)


def target_devices(target: str, count: int) -> list:
    """`count` devices of GPU `target` on one host, to compile for (never to run on)."""
    config = target_config(target)
    if not isinstance(count, int) or count <= 0:
        raise ConfigError(f"count={count!r} target devices: must be a positive integer")
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{count}", target_config=config)
    except (NotImplementedError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"target={target}: JAX cannot compile for CUDA here ({first[:160]}); the CUDA plugin "
                          f"is needed: {INSTALL}") from None
    return list(topology.devices)



def step_parallel(*, tensor: int, sequence_parallel: bool, data: int = 1, distributed_optimizer: bool = False,
                  pipeline: int = 1, schedule: str = "1f1b", virtual_stages: int = 1, context: int = 1,
                  strategy: str = "all-gather", fsdp: int = 1, offload_optimizer: bool = False) -> ParallelConfig:
    """The mesh a row's whole step compiles on. Data ranks all hold the same bytes unless the distributed
    optimizer splits the state over them: only then does the step compile on all d of them. FSDP ranks each hold
    their shard: the step compiles on all F."""
    return ParallelConfig(data=data if distributed_optimizer else 1, tensor=tensor, sequence_parallel=sequence_parallel,
                          distributed_optimizer=distributed_optimizer and data > 1, pipe=pipeline, schedule=schedule,
                          virtual_stages=virtual_stages, context=context, context_strategy=strategy, fsdp=fsdp,
                          offload_optimizer=offload_optimizer)


# XLA's GEMM choice without an autotuner: its own (a Triton fusion per GEMM, default tiles) or cuBLAS forced.
GEMMS = {"triton": {}, "cublas": {"xla_gpu_enable_triton_gemm": False}}


def gemm_programs(cfg: ModelConfig) -> tuple[str, ...]:
    """The GEMM programs (`GEMMS`) a run of `cfg` may get from the device's autotuner: either, but an FP8 run's, which
    compiles with Triton's GEMMs off (`model.compile_options`): the cuBLAS program alone."""
    return ("cublas",) if model.compile_options(cfg, "gpu") else tuple(GEMMS)


def compile_step(cfg: ModelConfig, parallel: ParallelConfig, remat: str, micro_batch: int, microbatches: int,
                 target: str, gemms: str = "triton", options: dict | None = None, offload: tuple[str, ...] = ()):
    """The real train step (AdamW, donated state, the model's dtype and depth, `microbatches` micro-batches of
    `micro_batch` sequences per data rank) compiled for `parallel.num_devices` devices of GPU `target`, its GEMMs
    as `gemms` says (`GEMMS`), or as XLA `options` say (a device's recorded choices: `planning.autotune`), with the
    options the model's run sets on a GPU (`model.compile_options`: an FP8 run's, the cuBLAS program whatever `gemms`
    says); the stored tensors `offload` names in host memory (jaxseq/offload.py)."""
    mesh = make_mesh(parallel, target_devices(target, parallel.num_devices))
    run = {**(GEMMS[gemms] if options is None else options), **model.compile_options(cfg, "gpu")}
    return aot.compile_train_step(on_platform(cfg, "gpu", parallel), parallel, remat, mesh, micro_batch, microbatches,
                                  run, offload)


@dataclass(frozen=True)
class StepProgram:
    """What a step's programs compiled for the GPU say: its peak bytes per device (the larger of the programs the
    device may run: `gemm_programs`), what the memory-bound kernels of the priced one move per step (None where not
    asked), the GEMMs it runs per step, of which FP8 (`hlo_flops.gemm_count`), and the FP8 copies its layer loops make
    per layer (`hlo_kernels.fp8_copy_bytes`; {} without FP8)."""

    peak_bytes: int
    moved_bytes: int | None
    gemms: hlo_flops.GemmCount
    fp8_copy_bytes_per_layer: dict


@lru_cache(maxsize=64)
def step_program(cfg: ModelConfig, parallel: ParallelConfig, remat: str, micro_batch: int, microbatches: int,
                 target: str, priced: bool = True, offload: tuple[str, ...] = ()) -> StepProgram:
    """The step compiled for `target` as `StepProgram` says: its time priced, and its GEMMs counted, on its Triton
    program (the one the time model was checked on), an FP8 run's on its cuBLAS program. Kept per process: a plan's
    rows, its block rows and a search's --verify ask for the same step more than once, and each is two or more
    whole-step compiles (a minute at gpt3-1.3b's shape)."""
    programs = {g: compile_step(cfg, parallel, remat, micro_batch, microbatches, target, g, offload=offload)
                for g in gemm_programs(cfg)}
    priced_text = (programs.get("triton") or programs["cublas"]).as_text()
    return StepProgram(max(aot.step_bytes(p) for p in programs.values()),
                       hlo_kernels.memory_bound_bytes(priced_text) if priced else None,
                       hlo_flops.gemm_count(priced_text),
                       hlo_kernels.fp8_copy_bytes(priced_text, cfg.layers // parallel.chunks) if cfg.fp8 else {})


def step_bytes(cfg: ModelConfig, parallel: ParallelConfig, remat: str, micro_batch: int, microbatches: int,
               target: str, offload: tuple[str, ...] = ()) -> int:
    """The step's peak bytes per device (argument + output + temp − alias, `aot.step_bytes`): the larger of its
    programs with Triton's and cuBLAS's GEMMs, either of which the device's autotuner may choose (an FP8 run's: the
    cuBLAS one, `gemm_programs`)."""
    return step_program(cfg, parallel, remat, micro_batch, microbatches, target, priced=False,
                        offload=offload).peak_bytes


def step_costs(cfg: ModelConfig, parallel: ParallelConfig, remat: str, micro_batch: int, microbatches: int,
               target: str, priced: bool = True, offload: tuple[str, ...] = ()) -> tuple[int, int | None]:
    """The step's peak bytes per device (as `step_bytes`) and what the memory-bound kernels of its Triton program (an
    FP8 run's cuBLAS one) move per step (`hlo_kernels.memory_bound_bytes`; None unless `priced`): the program's own
    memory and the traffic its time is priced by."""
    program = step_program(cfg, parallel, remat, micro_batch, microbatches, target, priced, offload)
    return program.peak_bytes, program.moved_bytes


def host_bytes(compiled) -> int:
    """Per-device bytes a compiled program holds in host memory: its host arguments (the optimizer state under
    --offload-optimizer, which its outputs alias) and temporaries (offloaded activations), XLA's own accounting."""
    m = compiled.memory_analysis()
    return (m.host_argument_size_in_bytes + m.host_output_size_in_bytes - m.host_alias_size_in_bytes
            + m.host_temp_size_in_bytes)


def step_memory(cfg: ModelConfig, parallel: ParallelConfig, remat: str, micro_batch: int, microbatches: int,
                target: str, offload: tuple[str, ...] = ()) -> tuple[int, int]:
    """(device peak, host bytes) per device of the step with `offload` (and the optimizer state where `parallel`
    offloads it): each the larger of its Triton-GEMM and cuBLAS-GEMM programs' (`step_bytes`, `host_bytes`)."""
    programs = [compile_step(cfg, parallel, remat, micro_batch, microbatches, target, g, offload=offload)
                for g in gemm_programs(cfg)]
    return max(aot.step_bytes(p) for p in programs), max(host_bytes(p) for p in programs)


@lru_cache(maxsize=64)
def stored_bytes_per_layer(cfg: ModelConfig, parallel: ParallelConfig, remat: str, micro_batch: int,
                           target: str, run: ParallelConfig | None = None) -> int:
    """One layer's stored activations in XLA:GPU's forward + backward of one micro-batch (no pipeline), with the
    kernels of the run's layout `run` (default `parallel`: `config.cudnn_compiles`), its layers scanned (an unrolled
    model stores the same per layer, without the stacks). Kept per process, as `step_program`."""
    mesh = make_mesh(parallel, target_devices(target, parallel.num_devices))
    small = replace(on_platform(cfg, "gpu", run or parallel), layers=MEASURE_LAYERS,
                    layer_loop="scan")  # read in its loop
    compiled = aot.compile_loss_and_grad(small, parallel, remat, mesh, micro_batch)
    return hlo_loops.stored_bytes_per_layer(compiled.as_text(), MEASURE_LAYERS)
