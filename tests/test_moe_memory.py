"""Stored bytes per layer per device of a mixture of experts' layer, read from the compiled program, against
`formulas.moe_activation_bytes` (the Llama attention half's terms and the MoE MLP's, `formulas.moe_tensor_bytes`):
exactly, for every remat policy, with and without SP, with capacity dropping and dropless, with shared experts, and
with the experts split over `expert` (float32 there: XLA:CPU's all-reduce promotion aborts on the bf16 program
with an expert or context axis); and the plan's rows (`plan --tensor 2` on tiny-moe) equal to it."""

import jax
import pytest

from jaxseq.config import ParallelConfig, replace
from jaxseq.mesh import make_mesh
from jaxseq.models import formulas as F
from jaxseq.planning import hlo_loops, measure
from jaxseq.planning import plan as P
from jaxseq.presets import preset
from jaxseq.remat import POLICIES
from jaxseq.training import aot

B = 2  # sequences per rank: a routing group of T = 128 tokens
TINY = replace(preset("tiny-moe"), dtype="bfloat16")  # E = 8, top-2, f = 48: C = ceil(1.25·128·2/8) = 40
VARIANTS = {
    "capacity": TINY,
    "dropless": replace(TINY, moe_capacity_factor=None),  # C = T = 128
    "dropping": replace(TINY, moe_capacity_factor=0.5),  # C = 16: most assignments dropped
    "shared": replace(TINY, moe_shared_experts=1),  # a shared SwiGLU every token passes through
    "float32": replace(TINY, dtype="float32", moe_capacity_factor=None, moe_aux_loss_coef=0.0),  # no loads
}


def stored(variant: str, remat: str, tensor: int, sp: bool, expert: int = 1) -> int:
    """The bytes per layer the compiled loss-and-gradient program's forward layer loop stores."""
    cfg = VARIANTS[variant]
    parallel = ParallelConfig(tensor=tensor, sequence_parallel=sp, expert=expert)
    mesh = make_mesh(parallel, jax.devices()[: parallel.num_devices])
    text = aot.compile_loss_and_grad(cfg, parallel, remat, mesh, B * expert).as_text()
    return hlo_loops.stored_bytes_per_layer(text, cfg.layers)


def formula(variant: str, remat: str, tensor: int, sp: bool) -> float:
    return F.activation_bytes(VARIANTS[variant], remat, B, tensor, sp)


def test_every_policy_has_a_moe_formula():
    assert set(F.MOE_POLICY_TERMS) == set(POLICIES)


def test_the_moe_terms_count_the_slots_by_hand():
    """tiny-moe, selective, t = 1: the dense layer's attention half and, at E·C = 320 slots of h = 64, f = 48 (bf16):
    float32 logits 4·T·E, routing 8 a slot, int32 loads 4·E, dispatched and output 2h a slot each, hidden 4f and
    SwiGLU's output 2f a slot."""
    cfg, tokens, slots, h, f = TINY, 128, 8 * 40, 64, 48
    dense = F.layer_tensor_bytes(cfg, B, 1, False)
    attention = 4 * dense["residual"] + 2 * dense["norm_stats"] + dense["q"] + dense["kv"] + dense["context"]
    moe = 4 * tokens * 8 + 8 * slots + 4 * 8 + 2 * slots * h + 2 * slots * 2 * f + 2 * slots * f + 2 * slots * h
    assert F.moe_activation_bytes(cfg, "selective", B, 1, False) == attention + moe


@pytest.mark.parametrize("variant, remat, tensor, sp, expert", [
    ("capacity", "selective", 2, True, 1),
    pytest.param("dropless", "lean", 2, False, 1, marks=pytest.mark.slow),
    pytest.param("shared", "dots", 1, False, 1, marks=pytest.mark.slow),
    ("float32", "none", 2, True, 2),
], ids=["selective-tp-sp", "lean-dropless", "dots-shared", "none-expert2-tp-sp"])
def test_the_compiled_moe_layer_stores_the_formula(variant, remat, tensor, sp, expert):
    assert stored(variant, remat, tensor, sp, expert) == formula(variant, remat, tensor, sp)


# Pairwise (18 programs, not 36): every policy of each variant once, dropping with SP, shared experts without (SP
# changes what they keep: the MLP input split), expert = 2 alternately; the capacity variant is the plan rows' below.
MATRIX = ([("dropping", 1, remat, True) for remat in sorted(POLICIES)]
          + [("shared", 1, remat, False) for remat in sorted(POLICIES)]
          + [("float32", 2, remat, i % 2 == 0) for i, remat in enumerate(sorted(POLICIES))])


@pytest.mark.slow
@pytest.mark.parametrize("variant, expert, remat, sp", MATRIX,
                         ids=[f"{v}-e{e}-{r}-{'sp' if sp else 'tp'}" for v, e, r, sp in MATRIX])
def test_every_policy_matches_the_compiled_moe_layer(variant, expert, remat, sp):
    assert stored(variant, remat, 2, sp, expert) == formula(variant, remat, 2, sp)


@pytest.mark.slow
def test_plan_rows_equal_the_formula():
    """The rows without SP that `python -m jaxseq.plan --preset tiny-moe --tensor 2` prints (every policy, `none` at
    t = 1 and 2; the SP rows' layers are the fast test's and the matrix's): each layer's program compiled as the plan
    compiles it (`measure.Compiler`) stores the plan's formula column to the byte."""
    rows = [c for c in P.configurations(2) if not c.sequence_parallel]
    compiler = measure.Compiler(TINY, B, jax.devices())
    keys = [compiler.programs(c)[0] for c in rows]  # ("grad", MEASURE_LAYERS, remat, t, sp)
    compiler.compile_all(keys)
    for c, key in zip(rows, keys):
        measured = hlo_loops.stored_bytes_per_layer(compiler._compile(*key).as_text(), measure.MEASURE_LAYERS)
        assert measured == P.formula_bytes_per_layer(TINY, c, B) == F.moe_activation_bytes(
            TINY, c.remat, B, c.tensor, c.sequence_parallel), c.name
