"""`plan --search` with the expert size e as a dimension, for a mixture of experts: the candidates split the data
ranks d × f × e; the state with the routed experts over e; the experts' GEMMs at their capacity-padded FLOPs; the two
all-to-alls per layer per pass on the hardware's links; the gradients' reduction split between the dense weights
(over d·e·c) and the routed experts (over d·c); text and JSON show e (a dense model's show nothing new); bad input in
one line. The fast tests read the layer's stored bytes from `formulas.moe_activation_bytes` (held to the compiled
layer in tests/test_moe_memory.py); the slow one compiles tiny-moe's layers as `plan --search` does."""

import math

import jax
import pytest

from commands import command
from jaxseq import plan as plan_command
from jaxseq.config import ConfigError, ParallelConfig, replace
from jaxseq.hardware import HARDWARE, Hardware
from jaxseq.models import experts, formulas
from jaxseq.mesh import make_mesh
from jaxseq.models.model import tagged_names
from jaxseq.offload import ALL, resolve
from jaxseq.planning import hlo, hlo_loops, host_tier, kernel_time, moe
from jaxseq.planning.costs import LayerCost
from jaxseq.planning.memory import non_layer_activation_bytes, state_bytes
from jaxseq.planning.search import search
from jaxseq.planning.search_costs import SearchCosts
from jaxseq.planning.search_report import format_result, to_json
from jaxseq.planning.search_space import Request, enumerate_candidates, validate_request
from jaxseq.presets import preset
from jaxseq.remat import MOE_EXCHANGE_REPLAYED
from jaxseq.training import aot

TINY = replace(preset("tiny-moe"), dtype="bfloat16")  # E = 8, top-2, capacity factor 1.25
NODE = Hardware(name="test", peak_tflops=100.0, memory_gib=1.0, hbm_gb_per_s=1000.0, sm_count=10, gpus_per_node=4,
                intra_node_gb_per_s=200.0, inter_node_gbit_per_s=100.0)


class FormulaCosts(SearchCosts):
    """A MoE layer's costs without compiling: stored bytes the formula the compiled layer equals, no collectives, a
    stated working memory (1 MB a sequence); the state from shapes (`SearchCosts.state`, as the search's own)."""

    def __init__(self, cfg):
        self.cfg, self._states = cfg, {}

    def prepare(self, keys, micro_batches=(1, 2)):
        pass

    def layer(self, t, sp, remat, b, context=1, strategy="all-gather"):
        cfg = self.cfg
        return LayerCost(formulas.activation_bytes(cfg, remat, b, t, sp), {}, 1e6 * b,
                         non_layer_activation_bytes(cfg, b, t, sp))


def request(**kw):
    return Request(**{"gpus": 16, "global_batch": 32, "hardware": NODE, "micro_batches": (1, 2),
                      "remats": ("selective", "full"), "expert_sizes": (1, 2, 4, 8), **kw})


def test_candidates_split_the_data_ranks_over_expert():
    """Every e asked that divides a mesh's data ranks; G = t·p·c·d·f·e, m = B/(d·f·e·b); without expert sizes (a
    dense request) every candidate has e = 1 and the same list as before e existed."""
    r = request()
    found = enumerate_candidates(TINY, r)
    assert {c.expert for c in found} == {1, 2, 4, 8}
    for c in found:
        assert c.tensor * c.pipe * c.context * c.data * c.fsdp * c.expert == r.gpus
        assert c.microbatches * c.data * c.fsdp * c.expert * c.micro_batch == r.global_batch
    one = enumerate_candidates(TINY, replace(r, expert_sizes=(1,)))
    assert one == [c for c in found if c.expert == 1]


def test_the_state_and_the_all_to_all_follow_e():
    """t = 1, p = 1, d = 2, e = 8 (16 GPUs, 4 a node): the state is `memory.state_bytes(expert=8)`'s, the routed
    experts 1/8 of e = 1's; EP s = m × L × (forward + backward) × one pass's all-to-all over expert ranks 1 apart, 4
    in a node (`moe.all_to_all`), at the links' efficiency; `full` adds a third pass (its replay)."""
    r = request(tensor_sizes=(1,), context_sizes=(1,))
    res = search(TINY, replace(r, hardware=replace(NODE, memory_gib=80.0)), FormulaCosts(TINY), "tiny-moe")
    rows = {(e.candidate.expert, e.candidate.remat, e.candidate.micro_batch, e.candidate.pipe,
             e.candidate.distributed_optimizer): e for e in res.ranked}
    one, eight = rows[(1, "selective", 1, 1, False)], rows[(8, "selective", 1, 1, False)]
    assert eight.memory.state_bytes == state_bytes(TINY, 1, 2, False, 1, 1, 8).at_peak
    assert one.memory.state_bytes - eight.memory.state_bytes == pytest.approx(
        (4 + 2 + 8 + 2) * moe.parameters(TINY).routed * 7 / 8)  # master, the copy's gradients in the loop, moments,
    #                                                             the bf16 copy
    tokens, layers, m = TINY.seq_len, TINY.layers, eight.candidate.microbatches
    per_pass = moe.all_to_all(TINY, tokens, 8, 1, NODE).seconds_per_pass
    assert eight.time.expert_s == pytest.approx(m * layers * 2 * per_pass / r.time_model.link_efficiency, rel=1e-12)
    assert one.time.expert_s == 0.0
    full = rows[(8, "full", 1, 1, False)]
    assert full.time.expert_s == pytest.approx(1.5 * eight.time.expert_s, rel=1e-12)


def test_the_gradients_reduce_dense_over_the_expert_ranks_and_routed_not():
    """All-reduce of the device's float32 gradients: the routed experts' (4 · routed/(t·e)) over d·c, the rest over
    d·e·c; e = 1 is the dense formula, 2(n − 1)/n of all of them over d·c."""
    r = request(tensor_sizes=(1,), context_sizes=(1,), hardware=replace(NODE, memory_gib=80.0))
    res = search(TINY, r, FormulaCosts(TINY), "tiny-moe")
    for e in res.ranked:
        c = e.candidate
        if c.distributed_optimizer or c.pipe > 1:
            continue
        grads = 4.0 * state_bytes(TINY, 1, c.data, False, 1, 1, c.expert).gradients / 4
        routed = 4.0 * moe.parameters(TINY).routed / c.expert
        ring = lambda n, g: 2 * n * (g - 1) / g if g > 1 else 0.0
        expected = ring(grads - routed, c.data * c.expert) + ring(routed, c.data)
        link = NODE.intra_node_gb_per_s if c.data * c.expert <= NODE.gpus_per_node else NODE.inter_node_gb_per_s
        assert e.time.dp_s == pytest.approx(expected / (link * 1e9 * r.time_model.link_efficiency), rel=1e-12), c


def test_the_experts_gemms_are_capacity_padded():
    """The time model's experts' GEMMs: E batches of C slots (C = ceil(1.25 · T · k/E)), the model FLOPs k experts a
    token: padded / model = E·C/(k·T) = the capacity factor where the ceiling is exact (T = 128: C = 40)."""
    b, t = 2, 2
    gemms = kernel_time.forward_gemms(TINY, b, t)
    tokens, slots = b * TINY.seq_len, experts.capacity(b * TINY.seq_len, TINY)
    assert slots == 40 and gemms["mlp_up"].batch == TINY.moe_experts and gemms["mlp_up"].m == slots
    model = formulas.layer_matmul_flops(TINY, b)
    padded = gemms["mlp_up"].flops + gemms["mlp_down"].flops
    assert padded * t / (model["mlp_up"] + model["mlp_down"]) == pytest.approx(1.25, rel=1e-12)
    assert model["router"] == gemms["router"].flops == 2 * tokens * TINY.hidden * TINY.moe_experts
    dense = formulas.layer_matmul_flops(replace(TINY, moe_experts=0), b)
    assert model["mlp_up"] == TINY.moe_top_k * dense["mlp_up"]  # k experts of width f


def test_the_b_scaled_layer_is_corrected_for_what_does_not_grow_with_b():
    """The search scales the b = 1 layer by b; a mixture's loads (4·E bytes, `lean`/`selective` keep them) do not
    grow with b and the capacity's ceiling need not: `moe_nonlinear_bytes` is the difference, 0 for a dense layer."""
    assert formulas.moe_nonlinear_bytes(TINY, "selective", 2, 1) == 4 * 8 - 2 * 4 * 8  # C = 20 at b = 1, 40 at 2
    odd = replace(TINY, moe_capacity_factor=1.3)  # C = ceil(20.8) = 21 at b = 1, ceil(62.4) = 63 at b = 3
    assert formulas.moe_nonlinear_bytes(odd, "dots", 3, 1) == 0  # dots keeps no loads; 63 = 3 · 21
    ceiling = replace(TINY, moe_capacity_factor=1.1)  # C = ceil(17.6) = 18 at b = 1, ceil(52.8) = 53 at b = 3
    per_slot = 8 * (2 * 2 * TINY.mlp_hidden + 2 * TINY.hidden)  # E slots of hidden (2e·2f) and output (2e·h), dots
    assert formulas.moe_nonlinear_bytes(ceiling, "dots", 3, 1) == (53 - 3 * 18) * per_slot
    assert formulas.moe_nonlinear_bytes(replace(TINY, moe_experts=0), "selective", 2, 1) == 0


def test_under_fp8_the_experts_stay_in_the_models_dtype():
    """--fp8 makes the attention's weight GEMMs FP8 GEMMs (models/fp8.py), not the experts' batched einsums: the time
    model prices them, and counts their quantization bytes, accordingly."""
    gemms = kernel_time.forward_gemms(replace(TINY, fp8=True), 1, 1)
    assert gemms["qkv"].fp8 and gemms["out"].fp8 and not gemms["mlp_up"].fp8 and not gemms["mlp_down"].fp8
    quantized = [g for g in gemms.values() if g.fp8]
    e = TINY.itemsize
    operands, outputs = sum(g.m * g.k + g.k * g.n for g in quantized), sum(g.m * g.n for g in quantized)
    assert kernel_time.fp8_quantize_bytes(replace(TINY, fp8=True), 1, 1) == 2 * (2 * e + 1) * operands + (
        3 * e + 2) * outputs


def test_the_dispatch_and_combine_bytes_by_hand():
    """b = 1: E·C = 8 · 20 slots of h = 64 (bf16): the gather reads and writes 2e, the combine reads e and adds into
    the float32 sum (8) a slot element; forward and backward, a third pass where the policy replays the exchange."""
    elements = 8 * 20 * 64
    assert kernel_time.moe_dispatch_bytes(TINY, 1, "selective") == 2 * elements * (2 * 2 + 2 + 8)
    assert kernel_time.moe_dispatch_bytes(TINY, 1, "dots") == 3 * elements * (2 * 2 + 2 + 8)
    dense = replace(TINY, moe_experts=0)
    swiglu = (kernel_time.layer_elementwise_bytes(TINY, 1, 1, False, "selective")
              - kernel_time.moe_dispatch_bytes(TINY, 1, "selective")
              - kernel_time.layer_elementwise_bytes(dense, 1, 1, False, "selective"))
    assert swiglu == (8 * 20 - 64) * TINY.mlp_hidden * (3 + 5) * 2  # SwiGLU over E·C slots, not the s·b tokens


def test_text_and_json_show_e_and_a_dense_search_does_not():
    r = request(tensor_sizes=(1,), context_sizes=(1,), hardware=replace(NODE, memory_gib=80.0))
    res = search(TINY, r, FormulaCosts(TINY), "tiny-moe")
    text = format_result(res, top=40)
    assert "   e" in text.splitlines()[5] and "EP s" in text and "e = expert-parallel size" in text
    out = to_json(res, top=40)
    assert {e["expert"] for e in out["ranked"]} == {1, 2, 4, 8} and out["expert_sizes"] == [1, 2, 4, 8]
    assert all("all_to_all" in e["time_s"] for e in out["ranked"])
    dense_cfg = replace(TINY, moe_experts=0)
    dense = search(dense_cfg, replace(r, expert_sizes=(1,)), FormulaCosts(dense_cfg), "dense")
    dense_json = to_json(dense)
    assert "EP s" not in format_result(dense) and "expert_sizes" not in dense_json
    assert all("expert" not in e and "all_to_all" not in e["time_s"] for e in dense_json["ranked"])


@pytest.mark.parametrize("sizes, message", [
    ((3,), "expert size 3 does not divide moe_experts=8; valid: 1, 2, 4, 8"),
    ((0,), "expert size 0 must be a positive integer"),
])
def test_bad_expert_sizes_in_one_line(sizes, message):
    with pytest.raises(ConfigError, match=message):
        validate_request(TINY, request(expert_sizes=sizes))
    with pytest.raises(ConfigError, match="this model has none"):
        validate_request(replace(TINY, moe_experts=0), request(expert_sizes=(1, 2)))


@pytest.mark.parametrize("argv, message", [
    (["--preset", "tiny-moe", "--expert-sizes", "3"], "expert size 3 does not divide moe_experts=8"),
    (["--preset", "tiny", "--expert-sizes", "1,2"], "this model has none (moe_experts=0)"),
    (["--preset", "tiny-moe", "--expert", "2"], "--search tries a list: --expert-sizes 2"),
])
def test_the_command_refuses_bad_expert_sizes_in_one_line(argv, message):
    result = command(plan_command.main, "--search", "--gpus", "8", "--global-batch", "8", *argv, check=False)
    assert result.returncode == 2 and message in result.stderr and result.stderr.count("\n") == 1, result.stderr


@pytest.mark.slow
def test_search_over_e_reads_the_compiled_moe_layer():
    """tiny-moe on 8 GPUs (one node), t = 1, compiled as `plan --search` compiles it: every e of 1, 2, 4, 8 ranked;
    each row's stored activations the compiled layer's, equal to `formulas.moe_activation_bytes` × the layers (the
    layer does not change with e), its state `memory.state_bytes(expert=e)`'s."""
    r = Request(8, 16, HARDWARE["h100"], (1, 2), ("selective",), tensor_sizes=(1,), context_sizes=(1,),
                expert_sizes=(1, 2, 4, 8))
    costs = SearchCosts(TINY, jax.devices()[:1])
    res = search(TINY, r, costs, "tiny-moe")
    assert {e.candidate.expert for e in res.ranked} == {1, 2, 4, 8} and res.compiled == 1
    for e in res.ranked:
        c = e.candidate
        stored = formulas.moe_activation_bytes(TINY, "selective", c.micro_batch, 1, False) * TINY.layers
        assert e.memory.activation_bytes == stored + non_layer_activation_bytes(TINY, c.micro_batch, 1, False), c
        if c.pipe == 1:
            state = state_bytes(TINY, 1, c.data, c.distributed_optimizer, 1, 1, c.expert)
            assert e.memory.state_bytes == state.at_peak, c
    assert math.isclose(min(e.time.expert_s for e in res.ranked if e.candidate.expert == 8), 0.0) is False


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "lean", "full", "dots"])
def test_the_all_to_alls_a_policy_replays_are_the_compiled_programs(devices, remat):
    """The time model's passes per layer (`remat.MOE_EXCHANGE_REPLAYED`: a third where the dispatched buffer is not
    kept) against the all-to-alls the compiled step runs at expert = 2 (float32: see tests/test_moe_memory.py)."""
    cfg = replace(TINY, dtype="float32")
    parallel = ParallelConfig(expert=2)
    text = aot.compile_loss_and_grad(cfg, parallel, remat, make_mesh(parallel, jax.devices()[:2]), 4).as_text()
    comps, runs = hlo.parse_hlo(text), hlo_loops.runs_per_call(text)
    count = sum(runs.get(comp, 0) for comp, instrs in comps.items() for ins in instrs
                if ins.opcode.removesuffix("-start") == "all-to-all")
    assert count == cfg.layers * 2 * (3 if remat in MOE_EXCHANGE_REPLAYED else 2)


@pytest.mark.parametrize("remat", ["none", "selective", "lean"])
@pytest.mark.parametrize("variant", [TINY, replace(TINY, moe_shared_experts=1)], ids=["routed", "shared"])
def test_offloading_everything_a_moe_layer_stores_is_its_formula(remat, variant):
    """host_tier's bytes of every name a policy stores (`--offload all`, and so the search's host tier) sum to
    `formulas.moe_activation_bytes` (a MoE name had no bytes before: `--search --offload-optimizer` failed with a
    traceback on a mixture)."""
    names = resolve(ALL, remat, tagged_names(variant))
    for sp in (False, True):
        assert host_tier.bytes_per_layer(variant, remat, names, 2, 2, sp) == pytest.approx(
            formulas.activation_bytes(variant, remat, 2, 2, sp), rel=1e-12)
