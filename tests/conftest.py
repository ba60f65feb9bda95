"""Every test runs on 8 simulated host devices (set before JAX initialises its backend)."""

import ctypes.util
import gc
import os
import shutil
import subprocess
import sys
import tempfile

# LLVM at -O0 (`--xla_backend_optimization_level=0`): the tests' programs are tiny, so compiling them is most of
# the suite's time, and LLVM's optimization of the CPU code is a third of each compile; the HLO, its buffers,
# FLOPs and collectives (what the tests read) are fixed before it (`aot.ANALYSIS_OPTIONS` says the same for
# the plan). And XLA:CPU's older fusion code generator where this XLA has it (`aot.LEGACY_CPU_FUSION`, jax 0.10:
# the whole suite in 9 min 49 s where it took 14 min 53 s, every test passing both ways), as the plan compiles
# what it reads. The commands the tests start inherit both.
LEGACY_CPU_FUSION = "--xla_cpu_use_fusion_emitters=false"
FLAGS_VARIABLE = "JAXSEQ_TESTS_XLA_FLAGS"  # the flags the first pytest process chose: xdist workers inherit them


def xla_knows(flag: str) -> bool:
    """Whether this XLA takes `flag` in XLA_FLAGS (it aborts the process on one it does not know)."""
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True,
                           env={**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"})
    return probe.returncode == 0


# jemalloc for the xdist workers and the commands the tests start, where the system has it (Debian's
# libjemalloc2, which .ci/run installs): XLA's compiler allocates many small objects, and glibc's malloc is
# 16% of a compile-bound test's time. The same programs and results; a pipelined test in 18.1 s against 22.2 s.
# LD_PRELOAD reaches only processes started after this: the workers, not this (controlling) process. And the
# first process's XLA flags (below), which the workers inherit.
if FLAGS_VARIABLE not in os.environ:
    if jemalloc := ctypes.util.find_library("jemalloc"):
        os.environ["LD_PRELOAD"] = " ".join(filter(None, (os.environ.get("LD_PRELOAD"), jemalloc)))
    flags = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    os.environ[FLAGS_VARIABLE] = flags + (" " + LEGACY_CPU_FUSION if xla_knows(LEGACY_CPU_FUSION) else "")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + os.environ[FLAGS_VARIABLE]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax._src import compiler as jax_compiler  # noqa: E402  (the one private name the tests patch: below)

from jaxseq.training import aot  # noqa: E402

# Python's cyclic garbage collector less often, and never over what the imports made (`gc.freeze`): tracing a
# step makes many containers, and at the default thresholds (700, 10, 10) the collector took 7% of a
# compile-bound test's time (8% less at these thresholds, in each of 4 runs). Only this process's; nothing a test
# reads.
gc.freeze()
gc.set_threshold(50_000, 20, 20)

# The same count as the option the training command sets: `jaxseq.train.main([... "--host-devices", "8"])`
# then runs in the pytest process (JAX refuses to change it once the backend has started).
jax.config.update("jax_num_cpu_devices", 8)

# One compilation cache for this session's pytest processes (and the commands a test starts with
# `commands.env(cache=True)`): a program that another test or the other xdist worker already compiled (in a
# quarter of a second or more) is loaded, not compiled again; the tiny preset's training runs, for one, share their
# train step. The first process (the xdist controller) makes the directory, the workers inherit it, and the maker
# removes it.
CACHE_VARIABLE = "JAXSEQ_TESTS_COMPILATION_CACHE"
MADE_CACHE = CACHE_VARIABLE not in os.environ
if MADE_CACHE:
    os.environ[CACHE_VARIABLE] = tempfile.mkdtemp(prefix="jaxseq-tests-compilation-cache-")
jax.config.update("jax_compilation_cache_dir", os.environ[CACHE_VARIABLE])
jax.config.update("jax_compilation_cache_max_size", 2**33)  # a bound: JAX then locks the directory between processes
# At -O0 most of the tests' programs compile in under JAX's default threshold of 1 s: cache those too.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.25)


def compile_branching_collectives_uncached(compile_or_get_cached):
    """JAX's compile step, but a program on several devices with branches (`stablehlo.case`: a pipeline's ticks)
    compiled rather than loaded from the cache: on XLA:CPU such a program loaded from it deadlocks
    (`aot.uncached_if_pipelined`, which guards the train command's step the same way; docs/testing.md). The
    tests' own pipelined programs (test_pipeline.py's, the layouts' in compiled_steps.py and elsewhere) pass here."""
    def compile(backend, computation, devices, *args, **kwargs):
        if np.size(devices) > 1 and "stablehlo.case" in str(computation):
            with aot.persistent_cache_off():
                return compile_or_get_cached(backend, computation, devices, *args, **kwargs)
        return compile_or_get_cached(backend, computation, devices, *args, **kwargs)
    return compile


jax_compiler.compile_or_get_cached = compile_branching_collectives_uncached(jax_compiler.compile_or_get_cached)


# With -n 2 --dist loadfile a module runs on one worker, handed out in the collection's order (pyproject.toml's
# --no-loadscope-reorder: pytest-xdist would order them by their number of tests instead, which put
# test_gpu_check.py's 1-minute dry run and test_context_overlap.py's ring compile among the last units). The
# longest modules go first, so that the workers end together rather than one waiting for the other's last long
# module (longest-processing-time-first: the idle tail is at most the shortest modules'). The order, estimated
# from `--durations` of the whole suite and the fast tier (2026-11-27), moves no test between modules and changes no
# test; modules not listed follow in their usual order.
LONGEST_FIRST = ["test_layouts", "test_context", "test_pipeline", "test_plan", "test_distributed", "test_search",
                 "test_resume", "test_fsdp", "test_zero_bubble", "test_llama", "test_bfloat16", "test_train",
                 "test_distributed_optimizer", "test_pipeline_train", "test_llama_memory", "test_gpu_check",
                 "test_checkpoint", "test_memory", "test_parallel", "test_step_loop", "test_train_step",
                 "test_generate", "test_flops", "test_convert", "test_llama_reference", "test_context_overlap",
                 "test_long_sequences", "test_ops_grad"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a module's own order is kept


def pytest_sessionfinish(session):
    if MADE_CACHE:
        shutil.rmtree(os.environ[CACHE_VARIABLE], ignore_errors=True)


@pytest.fixture
def no_persistent_cache():
    """A program compiled for target devices cannot be loaded back from JAX's persistent cache (no client to load it
    onto: a warning, then a compile again): the GPU-target modules compile theirs with it off
    (`aot.persistent_cache_off`; JAX's flag alone stays as the process's first compile read it)."""
    with aot.persistent_cache_off():
        yield


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, "tests expect 8 simulated host devices"
    return devs
