"""Which fusions of a step compiled with a GPU run's recorded GEMM choices found none (`autotune.without_a_choice`),
read from XLA's log without a GPU or JAX's CUDA plugin: the GEMMs among them are told by their HLO, and what cannot be
placed is one line (tests/test_gpu_target.py compiles with the plugin)."""

import pytest

from jaxseq.config import ConfigError
from jaxseq.planning.autotune import without_a_choice

STATUS = ". Status: NOT_FOUND: No autotuning result for the fusion in the loaded results\n"
LOOP = ('E1127 12:00:00.000000 1 autotuner.cc:212] Could not get config for HLO: %loop_add_fusion.13 = f32[2048]{0} '
        'fusion(f32[2048]{0} %p.1, f32[2048]{0} %p.2), kind=kLoop, calls=\n{\n  %param_0 = f32[2048]{0} parameter(0)\n'
        '  %param_1 = f32[2048]{0} parameter(1)\n  ROOT %add.3 = f32[2048]{0} add(%param_0, %param_1)\n}, '
        'backend_config={"fusion_backend_config":{"kind":"__triton"}}' + STATUS)


def gemm(name: str) -> str:
    return (f'E1127 12:00:00.000001 1 autotuner.cc:212] Could not get config for HLO: %{name} = bf16[8,2048]{{1,0}} '
            'fusion(bf16[8,2048]{1,0} %p.3, bf16[2048,2048]{1,0} %p.4), kind=kCustom, calls=\n{\n'
            '  %param_0 = bf16[8,2048]{1,0} parameter(0)\n  %param_1 = bf16[2048,2048]{1,0} parameter(1)\n'
            '  ROOT %dot.7 = bf16[8,2048]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, '
            'rhs_contracting_dims={0}\n}, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}' + STATUS)


def test_gemms_are_told_by_their_hlo_not_their_fusions_name():
    """A GEMM whose fusion XLA named as it names others (`fusion.7`, `loop_convert_fusion.2`) is a GEMM: the step is
    refused as not the device's program. Told apart by name, it was an optimizer fusion left to XLA's default, and
    the plan said "as the autotuner chose". The loop fusions the optimizer update leaves without a choice stay
    others (their backend is Triton's, but not a GEMM's)."""
    log = LOOP + gemm("gemm_fusion_dot.4") + gemm("fusion.7") + gemm("loop_convert_fusion.2")
    assert without_a_choice(log, refused=True) == (["gemm_fusion_dot.4", "fusion.7", "loop_convert_fusion.2"],
                                                   ["loop_add_fusion.13"])
    assert without_a_choice(LOOP, refused=True) == ([], ["loop_add_fusion.13"])
    assert without_a_choice("", refused=False) == ([], [])


@pytest.mark.parametrize("log, why", [
    ("Could not get config for HLO: %custom_fusion.3 = bf16[8,2048]{1,0} fusion(%p.3, %p.4), kind=kCustom" + STATUS,
     "XLA found no recorded choice for custom_fusion.3 and its log does not show what the fusion computes"),
    ("W1127 compile failed: NOT_FOUND", "XLA found no recorded choice for a fusion and its log names 0"),
    (LOOP + "E1127 autotuner.cc:230] Failed to get configs for: 3 out of 74",
     "XLA found no recorded choice for 3 fusions and its log names 1"),
])
def test_a_fusion_that_cannot_be_placed_is_one_line(log, why):
    """A fusion the log names without its body, not named as a GEMM, or a refusal for more fusions than the log
    names: they cannot be told from GEMMs, so the step is refused in one line rather than compiled with XLA's
    default in their place."""
    with pytest.raises(ConfigError, match="^" + why) as e:
        without_a_choice(log, refused=True)
    assert "\n" not in str(e.value)
