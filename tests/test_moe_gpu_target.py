"""A mixture of experts' GEMMs in XLA:GPU's program for H100s, compiled here without one (planning/gpu_target.py):
every expert matmul, forward and backward, is one batched GEMM over the local experts (a dot whose batch dimension
is the experts, in a Triton fusion or one cuBLAS call), never the dense expansion `jax.lax.ragged_dot` compiles to
(experiments/results/moe_gemms.md); on 2 expert ranks its dispatch and combine are NCCL all-to-alls."""

import pytest

from jaxseq.config import ParallelConfig, replace
from jaxseq.presets import preset
from jaxseq.mesh import make_mesh
from jaxseq.planning import gpu_target, hlo
from jaxseq.training import aot

pytest.importorskip("jax_cuda12_plugin", reason="the CUDA plugin: pip install -r requirements-gpu-target.txt")

EXPERT_GEMMS = ("enh,ehcf->encf", "enf,efh->enh")  # models/experts.expert_mlps


pytestmark = pytest.mark.usefixtures("no_persistent_cache")  # conftest.py: target programs are not loaded back


@pytest.mark.slow  # a MoE step compiled for 2 H100s, twice
@pytest.mark.parametrize("gemms", list(gpu_target.GEMMS))
def test_every_expert_matmul_is_one_batched_gemm_over_the_local_experts(gemms):
    cfg = replace(preset("tiny-moe"), dtype="bfloat16")
    parallel = ParallelConfig(expert=2)
    mesh = make_mesh(parallel, gpu_target.target_devices("h100", 2))
    lowered = aot.lower_loss_and_grad(cfg, parallel, "selective", mesh, 2)
    text = aot.compile_for_analysis(lowered, gpu_target.GEMMS[gemms]).as_text()
    local = cfg.moe_experts // parallel.expert
    gemm_ops = [ins for instrs in hlo.parse_hlo(text).values() for ins in instrs
                if any(op in hlo.op_name(ins.rest) for op in EXPERT_GEMMS)
                and (ins.opcode == "dot" or (ins.opcode == "custom-call" and hlo.CUBLAS in ins.rest))]
    assert len(gemm_ops) >= 6  # 2 forward, 4 backward (each input's and weight's gradient)
    for ins in gemm_ops:
        assert "lhs_batch_dims={0}" in ins.rest or '"lhs_batch_dimensions":["0"]' in ins.rest, ins.rest[:300]
        assert ins.arrays()[0][1][0] == local  # the batch: this rank's experts
    assert " all-to-all" in text or "all-to-all-start" in text
    assert "ragged" not in text
