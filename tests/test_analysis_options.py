"""What a plan compiles with (`aot.analysis_options`): the options change how fast XLA:CPU compiles, never what the
plan reads of the program."""

import jax
import pytest

from jaxseq.config import ParallelConfig, replace
from jaxseq.presets import preset
from jaxseq.mesh import make_mesh
from jaxseq.planning import hlo_collectives, hlo_flops, hlo_loops
from jaxseq.training import aot

FUSION_EMITTERS = {"xla_cpu_use_fusion_emitters": True}  # XLA:CPU's default, where the option exists


def _layer_program(devices):
    """A bf16 GPT layer's loss and gradients at t = 2 + SP under selective (2 layers: the layer loop stays)."""
    cfg = replace(preset("tiny"), dtype="bfloat16", layers=2)
    parallel = ParallelConfig(data=1, tensor=2, sequence_parallel=True)
    return aot.lower_loss_and_grad(cfg, parallel, "selective", make_mesh(parallel, devices[:2]), 2)


def _reading(compiled) -> tuple:
    """What the plan reads of a layer program: stored bytes, dot FLOPs, the layer loops' collectives."""
    text = compiled.as_text()
    collectives = [(c.kind, c.elements, c.group_size) for backward in (False, True)
                   for c in hlo_collectives.loop_collectives(text, 2, backward)]
    return (hlo_loops.stored_bytes_per_layer(text, 2), hlo_flops.program_dot_flops(text),
            sorted(collectives))


def test_the_older_cpu_fusion_generator_reads_the_same_layer(devices):
    """Where this XLA has `aot.LEGACY_CPU_FUSION` (jax 0.10), the plan compiles with it: the program the plan reads
    is the fusion emitters' in its stored bytes, dot FLOPs and collectives, and its temporaries within 1 KiB (the
    single ops the emitters wrap in fusions of their own stay bare: their text has no `wrapped_` computation).
    Where it has not (jax 0.12), XLA refuses the option and the plan compiles with `ANALYSIS_OPTIONS` alone."""
    lowered = _layer_program(devices)
    options = aot.analysis_options()
    if "xla_cpu_use_fusion_emitters" not in options:
        assert options == aot.ANALYSIS_OPTIONS
        with pytest.raises(jax.errors.JaxRuntimeError, match="xla_cpu_use_fusion_emitters"):
            lowered.compile(compiler_options={**aot.ANALYSIS_OPTIONS, **aot.LEGACY_CPU_FUSION})
        return
    assert options == {**aot.ANALYSIS_OPTIONS, **aot.LEGACY_CPU_FUSION}
    legacy = aot.compile_for_analysis(lowered)
    emitters = lowered.compile(compiler_options={**options, **FUSION_EMITTERS})
    assert "wrapped_" in emitters.as_text() and "wrapped_" not in legacy.as_text()  # each option took effect
    assert _reading(legacy) == _reading(emitters)
    stored, flops, collectives = _reading(legacy)
    assert stored > 0 and flops > 0 and {kind for kind, _, _ in collectives} >= {"all-gather", "reduce-scatter"}
    temp = (legacy.memory_analysis().temp_size_in_bytes, emitters.memory_analysis().temp_size_in_bytes)
    assert abs(temp[0] - temp[1]) <= 1024, temp
