"""Compiling ahead of time on abstract inputs (`jax.ShapeDtypeStruct` with shardings, nothing
allocated), and what a compiled program says about its memory: a 1T-parameter layer compiles on a
laptop, and a step that cannot fit is refused before it runs.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from jaxseq.config import ConfigError, ModelConfig, OptimizerConfig, ParallelConfig
from jaxseq.models import model
from jaxseq.parallel import context
from jaxseq.parallel.layout import Layout
from jaxseq.training import train_step


# What a plan compiles it reads and never runs. XLA's backend optimization level is LLVM's work on the machine
# code; the HLO, its buffers (memory_analysis), FLOPs (cost_analysis) and collectives are fixed before it. At 0 a
# program compiles in less time on XLA:CPU with every number the same (docs/testing.md).
ANALYSIS_OPTIONS = {"xla_backend_optimization_level": 0}

# XLA:CPU's older code generator for its fusions, which jax 0.10's XLA still has behind this option (jax 0.12's
# does not: the option is gone, and `analysis_options` leaves it out there). The fusion emitters it replaces wrap
# single ops (broadcasts, scatters, reduce-windows) in fusions of their own and compile each through MLIR, which
# is most of an analysis compile (the times: docs/testing.md). Every number a plan reads is the same but the
# working memory, a few bytes more (those ops' buffers): the dots, loops, stored activations and collectives are
# the same program's. XLA:GPU does not read it.
LEGACY_CPU_FUSION = {"xla_cpu_use_fusion_emitters": False}


@functools.cache
def analysis_options() -> dict:
    """ANALYSIS_OPTIONS and, where this XLA has the option, LEGACY_CPU_FUSION: probed once, on a scalar program
    (an option XLA does not know is an error, not ignored)."""
    options = {**ANALYSIS_OPTIONS, **LEGACY_CPU_FUSION}
    try:
        jax.jit(lambda x: x + 1).lower(np.float32(0)).compile(compiler_options=options)
    except jax.errors.JaxRuntimeError:
        return dict(ANALYSIS_OPTIONS)
    return options


def compile_for_analysis(lowered, options: dict | None = None):
    """`lowered.compile()` for a program whose accounting is read, not run (`analysis_options`, + `options`)."""
    return lowered.compile(compiler_options={**analysis_options(), **(options or {})})


class _CacheSwitch:
    """JAX's flag is one per process and the plan and the search compile in threads: the first to turn the cache
    off remembers how it was, the last to leave puts it back (saved and restored by each, two overlapping users
    left it off for good)."""

    lock = threading.Lock()
    users = 0
    enabled = True


@contextlib.contextmanager
def persistent_cache_off():
    """JAX's persistent compilation cache off for what compiles inside (in any thread, while one is inside), and as
    it was after. The flag alone is not enough: JAX reads it once per process, at its first compile, and
    `reset_cache` makes it read it again."""
    with _CacheSwitch.lock:
        if _CacheSwitch.users == 0:
            _CacheSwitch.enabled = jax.config.jax_enable_compilation_cache
            jax.config.update("jax_enable_compilation_cache", False)
            compilation_cache.reset_cache()
        _CacheSwitch.users += 1
    try:
        yield
    finally:
        with _CacheSwitch.lock:
            _CacheSwitch.users -= 1
            if _CacheSwitch.users == 0:
                jax.config.update("jax_enable_compilation_cache", _CacheSwitch.enabled)
                compilation_cache.reset_cache()


def uncached_if_pipelined(parallel: ParallelConfig, devices):
    """Where a compiled program must not come from JAX's persistent cache: a pipeline on XLA:CPU, whose programs
    loaded from it give every collective the same op id, so that devices reaching different collectives at the
    same moment (one stage's branch against another's) meet in each other's rendezvous and deadlock."""
    if parallel.pipe > 1 and devices[0].platform == "cpu":
        return persistent_cache_off()
    return contextlib.nullcontext()


def compile_partitioned(lowered):
    """(compiled, HLO text as XLA's SPMD partitioner leaves it) of `lowered` (a `jax.jit(...).lower(...)`): the
    collectives the partitioner inserted, each in the element type it chose. Why not the optimized program:
    XLA:CPU promotes every bf16 all-reduce and reduce-scatter to float32 after partitioning (its
    all-reduce-promotion pass), so the optimized text cannot tell a bf16 gradient reduction (what a GPU runs)
    from a float32 one. Compiles with the compilation cache off: a cached program runs no passes, and the
    cache key leaves the dump options out."""
    with tempfile.TemporaryDirectory(prefix="jaxseq-spmd-") as directory:
        with persistent_cache_off():
            compiled = lowered.compile(compiler_options={"xla_dump_to": directory, "xla_dump_hlo_as_text": True,
                                                         "xla_dump_hlo_pass_re": "spmd-partitioning"})
        files = glob.glob(os.path.join(directory, "*after_spmd-partitioning*.txt"))
        if len(files) != 1:
            raise RuntimeError(f"expected one HLO dump after spmd-partitioning, found {sorted(files)}")
        with open(files[0]) as f:
            return compiled, f.read()


def abstract_inputs(layout: Layout, micro_batch: int):
    """Sharded ShapeDtypeStructs for params and one batch: compile without allocating anything."""
    params = jax.tree.map(lambda shape, sharding: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding),
                          layout.param_shapes, layout.param_shardings, is_leaf=lambda x: isinstance(x, tuple))
    tokens = jax.ShapeDtypeStruct((micro_batch, layout.model.seq_len), jnp.int32, sharding=layout.batch["inputs"])
    return params, {"inputs": tokens, "targets": tokens}


def lower_loss_and_grad(cfg: ModelConfig, parallel: ParallelConfig, remat: str, mesh, micro_batch: int,
                        offload: tuple[str, ...] = ()):
    """The forward + backward of one micro-batch, lowered for `mesh` on abstract inputs."""
    layout = Layout(cfg, parallel, mesh)
    params, batch = abstract_inputs(layout, micro_batch)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=layout.replicated)
    return train_step.make_loss_and_grad(layout, remat, offload).lower(params, batch, key)


def compile_loss_and_grad(cfg: ModelConfig, parallel: ParallelConfig, remat: str, mesh, micro_batch: int,
                          offload: tuple[str, ...] = ()):
    """The forward + backward of one micro-batch, compiled for `mesh` (no optimizer: its memory is
    accounted separately and it does not touch activations)."""
    return compile_for_analysis(lower_loss_and_grad(cfg, parallel, remat, mesh, micro_batch, offload))


def compile_forward(cfg: ModelConfig, parallel: ParallelConfig, remat: str, mesh, micro_batch: int):
    """The loss alone (forward pass), compiled for `mesh`."""
    layout = Layout(cfg, parallel, mesh)
    params, batch = abstract_inputs(layout, micro_batch)
    shard = context.sharder(mesh, parallel)
    fn = jax.jit(lambda p, b, k: model.loss_fn(p, b, cfg, shard, remat, key=k))
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=layout.replicated)
    return compile_for_analysis(fn.lower(params, batch, key))


def abstract_step_inputs(layout: Layout, optimizer, rows: int):
    """(state, batch of `rows` sequences, key) of the train step as sharded ShapeDtypeStructs, the state in
    its own shardings (`train_step.state_shardings`): lower and compile the step without allocating anything."""
    shardings = train_step.state_shardings(layout, optimizer)
    abstract = jax.eval_shape(lambda: train_step.init_state(jax.random.key(0), layout, optimizer))
    state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abstract, shardings)
    _, batch = abstract_inputs(layout, rows)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=layout.replicated)
    return state, batch, key


def compile_train_step(cfg: ModelConfig, parallel: ParallelConfig, remat: str, mesh, micro_batch: int,
                       microbatches: int = 1, options: dict | None = None, offload: tuple[str, ...] = ()):
    """The real train step (AdamW, donated state) of `microbatches` micro-batches of `micro_batch` sequences
    per data (× fsdp) rank, compiled for `mesh` (with XLA `options` beside `analysis_options`)."""
    layout = Layout(cfg, parallel, mesh)
    optimizer = train_step.make_optimizer(OptimizerConfig(), cfg)
    inputs = abstract_step_inputs(layout, optimizer, micro_batch * microbatches * parallel.batch_ranks)
    step = train_step.make_train_step(layout, remat, optimizer, micro_batches=microbatches, offload=offload)
    return compile_for_analysis(step.lower(*inputs), options)


# ---------------------------------------------------------------------------------------------
# Will it fit? The compiled step's own memory accounting against the device's memory

GIB = 2**30


def step_bytes(compiled) -> int | None:
    """Per-device bytes a compiled program needs: arguments + outputs + temporaries − the buffers
    outputs reuse from (donated) arguments. None where the backend gives no analysis."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def evaluation_bytes(evaluation, step, params) -> int | None:
    """Per-device bytes while the compiled `evaluation` runs between train steps: what stays alive from the
    step (its arguments: the whole train state and the next batch, already queued) + the evaluation's own
    arguments but the parameters (they are the state's: its batch), temporaries and output. The step's
    temporaries are freed by then (its loss was read before evaluating). None where either program gives no
    analysis. `params`: the parameters evaluated (arrays or ShapeDtypeStructs with shardings)."""
    m, s = evaluation.memory_analysis(), step.memory_analysis()
    if m is None or s is None:
        return None
    own = m.argument_size_in_bytes - per_device_bytes(params)
    return s.argument_size_in_bytes + own + m.temp_size_in_bytes + m.output_size_in_bytes


def sampling_bytes(sampler, step) -> int | None:
    """Per-device bytes while the end-of-run sample runs (`sampling.compile_sampler`'s programs: `reshard`,
    `prefill`, `decode`): the train state stays alive (the step's arguments), the resharded parameters (the
    reshard's output) beside it, and the largest of the reshard's temporaries and a prefill's or decode's
    own (its cache and token out, temporaries; the decode's cache is donated). None where a program gives no
    analysis."""
    s, r, p, d = (x.memory_analysis() for x in (step, sampler.reshard, sampler.prefill, sampler.decode))
    if None in (s, r, p, d):
        return None
    prefill = p.temp_size_in_bytes + p.output_size_in_bytes
    decode = d.temp_size_in_bytes + d.output_size_in_bytes  # its cache argument is its output's buffer
    return s.argument_size_in_bytes + r.output_size_in_bytes + max(r.temp_size_in_bytes, prefill, decode)


def per_device_bytes(tree) -> int:
    """Bytes of one device's shard of every array in `tree` (each leaf has .shape, .dtype and .sharding)."""
    return sum(int(np.prod(a.sharding.shard_shape(a.shape), dtype=np.int64)) * np.dtype(a.dtype).itemsize
               for a in jax.tree.leaves(tree))


def device_bytes(devices) -> int | None:
    """Memory one device may use: the backend's `bytes_limit` (GPU, TPU); for CPU devices, which
    share the host's memory, the physical memory divided among the local devices; None if unknown."""
    local = [d for d in devices if d.process_index == jax.process_index()]  # only these report stats
    if not local:
        return None
    stats = local[0].memory_stats() if hasattr(local[0], "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if local[0].platform == "cpu" and hasattr(os, "sysconf"):
        try:
            host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
        return host // len(local)
    return None


# What would help, by program: the evaluation stores nothing for a backward, so remat does not change it.
REMEDIES = {
    "train step": "try a smaller --micro-batch-size, a remat policy that stores less (--remat full or lean), "
                  "or more tensor parallelism (--mesh tensor=N --sequence-parallel)",
    "evaluation": "try a smaller --micro-batch-size, or more tensor or pipeline parallelism "
                  "(--mesh tensor=N --sequence-parallel, pipe=P)",
    "end-of-run sample": "try sample_tokens=0 (no sample), or more tensor or pipeline parallelism "
                         "(--mesh tensor=N, pipe=P: sampling splits the weights over both)",
}


def check_fits(needed: int | None, available: int | None, what: str = "train step") -> None:
    """Refuse, in one line, a program (`REMEDIES`' keys: the train step, the evaluation, the sample) that needs more
    memory than a device has (either unknown: no check)."""
    if needed is None or available is None or needed <= available:
        return
    raise ConfigError(f"the compiled {what} needs {needed / GIB:.2f} GiB per device but a device has "
                      f"{available / GIB:.2f} GiB; {REMEDIES[what]}")
