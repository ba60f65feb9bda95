"""The plan's mixture-of-experts terms (planning/moe.py, `plan --expert E`): total and active parameters against
the models' published counts; the state per device with the experts split over `expert` against the arrays the
train step's layout places; the all-to-all's split between NVLink and InfiniBand; bad input in one line. (The
all-to-all's elements against the compiled program: tests/test_expert_parallel.py.) Nothing here compiles."""

import jax
import numpy as np
import pytest

from commands import command
from jaxseq import plan as plan_command
from jaxseq.config import ParallelConfig, replace
from jaxseq.presets import preset
from jaxseq.hardware import HARDWARE
from jaxseq.mesh import make_mesh
from jaxseq.models import formulas
from jaxseq.parallel.layout import Layout
from jaxseq.planning import memory, moe
from jaxseq.planning import plan as plan_rows

# Published (B, rounded to 0.1 B): Mixtral 8x7B 46.7 total, 12.9 active (Mistral AI); Qwen3-30B-A3B 30.5 total,
# 3.3 active (its model card; jaxseq's count, its q/k norms included, is transformers' 30,532,122,624 and reads 3.35
# active).
PUBLISHED = {"mixtral-8x7b": (46.7e9, 12.9e9), "qwen3-30b-a3b": (30.5e9, 3.3e9)}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_total_and_active_parameters_are_the_published_counts(name):
    p = moe.parameters(preset(name))
    total, active = PUBLISHED[name]
    assert abs(p.total - total) <= 0.05e9 and abs(p.active - active) <= 0.06e9, p


@pytest.mark.parametrize("parallel", [ParallelConfig(expert=4, data=2), ParallelConfig(expert=2, tensor=2, data=2)])
def test_the_state_per_device_is_what_the_layout_places(devices, parallel):
    """Master weights: 4 bytes an element of each device's shard as the train step's layout places them; gradients
    as many, Adam's moments twice; the routed experts 1/E of them."""
    cfg = replace(preset("tiny-moe"), dtype="float32")
    layout = Layout(cfg, parallel, make_mesh(parallel, jax.devices()[: parallel.num_devices]))
    shapes = jax.tree.leaves(layout.param_shapes, is_leaf=lambda x: isinstance(x, tuple))
    shardings = jax.tree.leaves(layout.master_shardings)
    placed = sum(int(np.prod(s.shard_shape(shape))) for shape, s in zip(shapes, shardings))
    state = memory.state_bytes(cfg, parallel.tensor, expert=parallel.expert)
    assert state.params == 4 * placed
    assert state.gradients == 4 * placed and state.optimizer == 8 * placed
    whole = memory.state_bytes(cfg, parallel.tensor)
    routed = moe.parameters(cfg).routed // parallel.tensor
    assert whole.params - state.params == 4 * routed * (parallel.expert - 1) // parallel.expert


def test_the_all_to_all_crosses_infiniband_only_past_a_node():
    """Qwen3-30B-A3B at a 4,096-token group, bf16: [E, C, h] twice a pass; 8 expert ranks in a DGX H100 all on
    NVLink, 16 half of what leaves a GPU to the other node."""
    cfg, hw = preset("qwen3-30b-a3b"), HARDWARE["h100"]
    elements = 2 * 128 * 320 * 2048  # C = ceil(1.25 · 4096 · 8 / 128) = 320
    assert moe.all_to_all_elements(cfg, 4096) == elements
    eight, sixteen = moe.all_to_all(cfg, 4096, 8, 1, hw), moe.all_to_all(cfg, 4096, 16, 1, hw)
    assert eight.bytes_per_pass == 2 * elements and eight.infiniband_bytes == 0
    assert eight.nvlink_bytes == 2 * elements * 7 // 8
    assert sixteen.nvlink_bytes == 2 * elements * 7 // 16 and sixteen.infiniband_bytes == 2 * elements * 8 // 16
    assert sixteen.seconds_per_pass == pytest.approx(elements / (hw.inter_node_gb_per_s * 1e9))
    spread = moe.all_to_all(cfg, 4096, 8, 8, hw)  # tensor = 8 between expert ranks: each in its own node
    assert spread.nvlink_bytes == 0 and spread.infiniband_bytes == 2 * elements * 7 // 8


@pytest.mark.parametrize("argv, message", [
    (["--preset", "tiny-moe", "--expert", "3"], "expert=3 does not divide moe_experts=8"),
    (["--preset", "tiny-llama", "--expert", "2"], "this model has none (moe_experts=0)"),
    (["--preset", "tiny-moe", "--expert", "2", "--hardware", "tpu"], "hardware='tpu' is not known"),
])
def test_bad_input_is_refused_in_one_line(argv, message):
    result = command(plan_command.main, *argv, "--tensor", "1", check=False)
    assert result.returncode == 2 and message in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_the_report_prints_each_term_with_its_unit():
    """The lines `plan` prints after its table for Qwen3-30B-A3B at EP 16 on H100s (b = 1, no pipeline)."""
    cfg = preset("qwen3-30b-a3b")
    text = moe.report(cfg, tensor=1, expert=16, context=1, micro_batch=1, microbatches=1, hw=HARDWARE["h100"])
    p, split = moe.parameters(cfg), memory.state_bytes(cfg, 1, expert=16)
    assert f"{p.total:,} total, {p.active:,} active per token" in text
    assert f"{split.total / 2**30:.1f} GiB at expert = 16" in text
    assert "320.0 MiB, of which 140.0 MiB over NVLink (450 GB/s) and 160.0 MiB over InfiniBand (50 GB/s)" in text


@pytest.mark.parametrize("context", [1, 2])
def test_the_plans_formula_column_is_the_moe_layers(context):
    """The plan's formula column for a mixture is `formulas.moe_activation_bytes` (its MoE MLP's terms, not the dense
    Llama layer's MLP), with and without context parallelism; the dense Llama layer keeps its own."""
    rows = plan_rows.configurations(2)
    cfg = preset("tiny-moe")
    for r in rows:
        got = plan_rows.formula_bytes_per_layer(cfg, r, 1, context)
        assert got == formulas.moe_activation_bytes(cfg, r.remat, 1, r.tensor, r.sequence_parallel, context)
        dense = formulas.activation_bytes(replace(cfg, moe_experts=0), r.remat, 1, r.tensor, r.sequence_parallel,
                                          context)
        assert got != dense or r.remat == "full", r.name
    assert all(plan_rows.formula_bytes_per_layer(preset("tiny-llama"), r, 1, context) for r in rows)
