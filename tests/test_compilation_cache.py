"""JAX's persistent compilation cache turned off where a program must be compiled (`aot.persistent_cache_off`): a
pipeline's step on XLA:CPU, which deadlocks when loaded from it (docs/testing.md), and the SPMD dump
(`aot.compile_partitioned`), which a loaded program does not write. JAX reads its flag once per process, so the
flag alone, turned off after the process's first compile, leaves the cache on: the first test shows it."""

import os

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.compilation_cache import compilation_cache

from jaxseq.config import ParallelConfig
from jaxseq.training import aot


@pytest.fixture
def cache_everything():
    """The suite's cache (conftest.py) for programs of any compile time, read afresh (`reset_cache`: whatever an
    earlier test left), as it was after."""
    was = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    compilation_cache.reset_cache()
    yield jax.config.jax_compilation_cache_dir
    jax.config.update("jax_persistent_cache_min_compile_time_secs", was)


def entries(directory: str) -> int:
    return len(os.listdir(directory))


def compile_new_program(scale: float) -> None:
    """A program no test compiled before (its constant is its own)."""
    jax.jit(lambda x: x * scale + 1.0).lower(jnp.ones(3)).compile()


def test_the_flag_alone_does_not_turn_the_cache_off_once_it_is_read(cache_everything):
    compile_new_program(1.0625)  # the process has read the flag (it has, in any test after the first)
    before = entries(cache_everything)
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        compile_new_program(1.125)
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
    assert entries(cache_everything) > before


def test_inside_persistent_cache_off_nothing_is_written_and_after_it_is(cache_everything):
    compile_new_program(1.1875)
    before = entries(cache_everything)
    with aot.persistent_cache_off():
        compile_new_program(1.25)
    assert entries(cache_everything) == before
    compile_new_program(1.3125)
    assert entries(cache_everything) > before


@pytest.mark.parametrize("pipe, cached", [(1, True), (2, False)])
def test_a_pipeline_on_the_cpu_compiles_uncached(cache_everything, pipe, cached):
    before = entries(cache_everything)
    with aot.uncached_if_pipelined(ParallelConfig(pipe=pipe), jax.devices()):
        compile_new_program(1.375 + pipe)
    assert (entries(cache_everything) > before) == cached


def test_threads_that_overlap_leave_the_cache_as_it_was(cache_everything):
    """The plan's and the search's compiles run in threads: two uses of `persistent_cache_off` that overlap, the
    first leaving before the second, leave JAX's flag on (each saving and restoring it had left it off)."""
    first, second = aot.persistent_cache_off(), aot.persistent_cache_off()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not jax.config.jax_enable_compilation_cache  # the second is still inside
    second.__exit__(None, None, None)
    assert jax.config.jax_enable_compilation_cache
    before = entries(cache_everything)
    compile_new_program(1.4375)
    assert entries(cache_everything) > before
