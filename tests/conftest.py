"""Every test runs on 8 simulated host devices (set before JAX initialises its backend)."""

import os
import shutil
import tempfile

# LLVM at -O0 (`--xla_backend_optimization_level=0`): the tests' programs are tiny, so compiling them is most of
# the suite's time, and LLVM's optimization of the CPU code is a third of each compile; the HLO, its buffers,
# FLOPs and collectives (what the tests read) are fixed before it (`aot.ANALYSIS_OPTIONS` says the same for
# the plan). The commands the tests start inherit it.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

# The same count as the option the training command sets: `jaxseq.train.main([... "--host-devices", "8"])`
# then runs in the pytest process (JAX refuses to change it once the backend has started).
jax.config.update("jax_num_cpu_devices", 8)

# One compilation cache for this session's pytest processes (and the commands a test starts with
# `commands.env(cache=True)`): a program that another test or the other xdist worker already compiled (in a
# quarter of a second or more) is loaded, not compiled again; the tiny preset's training runs, for one, share their train step. The first
# process (the xdist controller) makes the directory, the workers inherit it, and the maker removes it.
CACHE_VARIABLE = "JAXSEQ_TESTS_COMPILATION_CACHE"
MADE_CACHE = CACHE_VARIABLE not in os.environ
if MADE_CACHE:
    os.environ[CACHE_VARIABLE] = tempfile.mkdtemp(prefix="jaxseq-tests-compilation-cache-")
jax.config.update("jax_compilation_cache_dir", os.environ[CACHE_VARIABLE])
jax.config.update("jax_compilation_cache_max_size", 2**33)  # a bound: JAX then locks the directory between processes
# At -O0 most of the tests' programs compile in under JAX's default threshold of 1 s: cache those too.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.25)


def pytest_sessionfinish(session):
    if MADE_CACHE:
        shutil.rmtree(os.environ[CACHE_VARIABLE], ignore_errors=True)


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, "tests expect 8 simulated host devices"
    return devs
