"""What XLA's partitioner made of the sharding annotations, read from the compiled HLO.

The assertions are about what the design promises, in a form that holds across XLA versions (they
pass on jax 0.10.2 and 0.12.0.1): how many bytes each layer moves, which matmul's output (or input
gradient) each collective reduces or scatters, what is gathered, and that no weight is gathered.
How XLA spells a reduce-scatter differs between versions (an all-reduce whose value is only
dynamic-sliced, or the fused op); hlo_collectives.loop_collectives reads both as a reduce-scatter.
"""

import re
from collections import Counter

import pytest

from jaxseq.planning import hlo_collectives, hlo_loops
from jaxseq.planning.hlo import parse_hlo
from jaxseq.planning.search_time import ring_traffic

from compiled import B, H, L, MEMORY_CFG, S, T, hlo

ACTIVATION = B * S * H  # elements of one [b, s, h] activation per device (data = 1)
ITEMSIZE = 2  # bf16 activations (XLA:CPU moves them as f32: counted at the activation dtype)
# Ring bytes each device sends for one [b, s, h] activation: all-gather or reduce-scatter N(t-1)/t,
# all-reduce twice that.
ONE_WAY = ACTIVATION * ITEMSIZE * (T - 1) / T
# The einsums of model.block, as HLO metadata names them.
ATTN_OUT, MLP_DOWN = "bsad,adh->bsh", "bsf,fh->bsh"  # row-parallel: partial sums reduced
MLP_UP = "bsh,hf->bsf"  # column-parallel: the input gradient reduced
# Q, K and V's input gradient, summed on each rank and all-reduced once: the transpose of the cast to varying over
# `tensor` by which their region enters (Sharder.column_parallel), as HLO metadata names it.
QKV_ENTRY = "psum_invariant"


def _activation_ops(text: str, backward: bool) -> list:
    """The per-layer collectives that move [b, s, h] activations over the tensor group (parameter-
    gradient reductions, e.g. of sequence-parallel LayerNorm weights, are excluded)."""
    return [c for c in hlo_collectives.loop_collectives(text, L, backward)
            if c.elements == ACTIVATION and c.group_size == T]


def activation_collectives(text: str, backward: bool) -> Counter:
    return Counter(c.kind for c in _activation_ops(text, backward))


def sources(text: str, backward: bool) -> Counter:
    """(kind, what it came from): the einsum whose output or input gradient it reduces, or the
    explicit shard_map all_gather / psum_scatter of the sequence-parallel entry."""
    def origin(c):
        m = re.search(r"([a-z]+,[a-z]+->[a-z]+)/dot_general", c.source)
        return m.group(1) if m else c.source.rsplit("/", 1)[-1]
    return Counter((c.kind, origin(c)) for c in _activation_ops(text, backward))


def traffic(text: str, backward: bool) -> float:
    return sum(ring_traffic(c.kind, c.elements * ITEMSIZE, c.group_size) for c in _activation_ops(text, backward))


def assert_no_weight_is_gathered(text: str):
    """Tensor parallelism keeps every weight sharded: the only all-gathers in the layer loops are of
    [b, s, h] activations, and everything else is a reduction."""
    for backward in (False, True):
        for c in hlo_collectives.loop_collectives(text, L, backward):
            assert c.kind != "all-gather" or c.elements == ACTIVATION, c


def test_tensor_parallel_all_reduces_activations():
    """Megatron's f and g: forward all-reduces the outputs of the two row-parallel matmuls, backward
    the input gradients of the two column-parallel ones; 2 all-reduces of [b, s, h] each way."""
    text = hlo("selective", False)
    assert sources(text, backward=False) == Counter({("all-reduce", ATTN_OUT): 1, ("all-reduce", MLP_DOWN): 1})
    assert sources(text, backward=True) == Counter({("all-reduce", QKV_ENTRY): 1, ("all-reduce", MLP_UP): 1})
    for backward in (False, True):
        assert traffic(text, backward) == 2 * 2 * ONE_WAY
    assert_no_weight_is_gathered(text)


def test_sequence_parallel_turns_each_all_reduce_into_all_gather_plus_reduce_scatter():
    """Forward SP: the row-parallel outputs are reduce-scattered along the sequence instead of
    all-reduced, and the sequence-sharded LayerNorm outputs are all-gathered (the explicit shard_map
    all_gather) before the column-parallel matmuls; nothing else is gathered."""
    text = hlo("selective", True)
    assert sources(text, backward=False) == Counter({("reduce-scatter", ATTN_OUT): 1, ("reduce-scatter", MLP_DOWN): 1,
                                                     ("all-gather", "all_gather"): 2})
    # The paper's claim: the same bytes on the wire as tensor parallelism's all-reduces.
    assert traffic(text, backward=False) == 4 * ONE_WAY == traffic(hlo("selective", False), backward=False)
    assert_no_weight_is_gathered(text)


def test_sequence_parallel_backward_regathers_the_stored_sharded_inputs():
    """Backward: 2 all-gathers conjugate to the forward reduce-scatters, 2 reduce-scatters conjugate
    to the forward all-gathers (the shard_map psum_scatter), and 2 extra all-gathers that re-gather
    the sequence-sharded LayerNorm outputs SP stores instead of the gathered ones (the rematerialised
    shard_map all_gather; Megatron-LM does the same): +50% backward traffic over TP, the price of
    storing 2·sbh/t instead of 2·sbh twice per layer."""
    sp = hlo("selective", True)
    assert activation_collectives(sp, backward=True) == Counter({"all-gather": 4, "reduce-scatter": 2})
    assert sources(sp, backward=True)[("reduce-scatter", "reduce_scatter")] == 2
    assert sources(sp, backward=True)[("all-gather", "all_gather")] == 2
    assert traffic(sp, backward=True) == 6 * ONE_WAY == 1.5 * traffic(hlo("selective", False), backward=True)


@pytest.mark.slow
def test_full_recompute_replays_the_forward_collectives_but_the_last():
    """Full recompute replays one forward in backward, except the last row-parallel matmul whose
    output the backward never needs: the attention projection's all-reduce is replayed (3 all-reduces
    with TP, not 4), the MLP-down one is not; with SP the replayed one is a reduce-scatter."""
    tp = hlo("full", False)
    assert sources(tp, backward=True) == Counter({("all-reduce", ATTN_OUT): 1, ("all-reduce", QKV_ENTRY): 1,
                                                  ("all-reduce", MLP_UP): 1})
    assert traffic(tp, backward=True) == 3 * 2 * ONE_WAY
    sp = hlo("full", True)
    assert activation_collectives(sp, backward=True) == Counter({"all-gather": 4, "reduce-scatter": 3})
    assert sources(sp, backward=True)[("reduce-scatter", ATTN_OUT)] == 1
    assert sources(sp, backward=True)[("reduce-scatter", MLP_DOWN)] == 0
    assert_no_weight_is_gathered(tp)
    assert_no_weight_is_gathered(sp)


# A loop body where an all-reduce feeds a fusion that also slices a stacked bias (as newer XLA fuses
# them), and another all-reduce whose value is only sliced (a reduce-scatter on GPU/TPU).
_TWO_REDUCTIONS = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%bias_fusion (p0: f32[4,8], p1: f32[2,8], p2: s32[]) -> f32[4,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[2,8]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  %ds = f32[1,8]{1,0} dynamic-slice(%p1, %p2, %zero), dynamic_slice_sizes={1,8}
  %bc = f32[8]{0} bitcast(%ds)
  %bb = f32[4,8]{1,0} broadcast(%bc), dimensions={1}
  ROOT %out = f32[4,8]{1,0} add(%p0, %bb)
}

%convert_fusion (p0: f32[4,8]) -> bf16[4,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  ROOT %c = bf16[4,8]{1,0} convert(%p0)
}

%slice_fusion (p0: bf16[4,8], p1: s32[]) -> bf16[1,8] {
  %p0 = bf16[4,8]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = bf16[1,8]{1,0} dynamic-slice(%p0, %p1, %zero), dynamic_slice_sizes={1,8}
}

%body (param: (s32[], f32[4,8], f32[2,8])) -> (s32[], f32[4,8], f32[2,8]) {
  %param = (s32[], f32[4,8]{1,0}, f32[2,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%param), index=1
  %bias = f32[2,8]{1,0} get-tuple-element(%param), index=2
  %ar = f32[4,8]{1,0} all-reduce(%x), replica_groups={{0,1,2,3}}, to_apply=%add
  %y = f32[4,8]{1,0} fusion(%ar, %bias, %i), kind=kLoop, calls=%bias_fusion
  %ar2 = f32[4,8]{1,0} all-reduce(%y), replica_groups={{0,1,2,3}}, to_apply=%add
  %cv = bf16[4,8]{1,0} fusion(%ar2), kind=kLoop, calls=%convert_fusion
  %z = bf16[1,8]{1,0} fusion(%cv, %i), kind=kLoop, calls=%slice_fusion
  ROOT %t = (s32[], f32[4,8]{1,0}, f32[2,8]{1,0}) tuple(%i, %y, %bias)
}

ENTRY %main (init: (s32[], f32[4,8], f32[2,8])) -> (s32[], f32[4,8], f32[2,8]) {
  %init = (s32[], f32[4,8]{1,0}, f32[2,8]{1,0}) parameter(0)
  ROOT %w = (s32[], f32[4,8]{1,0}, f32[2,8]{1,0}) while(%init), body=%body, \
backend_config={"known_trip_count":{"n":"2"}}
}
"""


def test_an_all_reduce_is_a_reduce_scatter_only_when_its_own_value_is_sliced():
    ops = hlo_collectives.loop_collectives(_TWO_REDUCTIONS, 2, backward=False)
    assert [(c.kind, c.elements, c.group_size) for c in ops] == [("all-reduce", 32, 4), ("reduce-scatter", 32, 4)]


def _forward_loop_tuple(text: str) -> list:
    comps = parse_hlo(text)
    loop = next(l for l in hlo_loops.layer_loops(comps, L) if not l.backward)
    ins = next(i for c in comps.values() for i in c if i.name == loop.name)
    return ins.arrays()


def test_residual_stream_is_sequence_sharded_between_blocks():
    sp = _forward_loop_tuple(hlo("selective", True))
    assert ("bf16", (B, S // T, H)) in sp  # the carried residual stream
    assert ("bf16", (B, S, H)) not in sp
    assert ("bf16", (L, B, S // T, H)) in sp  # the stored layer input
    tp = _forward_loop_tuple(hlo("selective", False))
    assert ("bf16", (B, S, H)) in tp


def test_no_op_holds_the_full_logits():
    vocab = MEMORY_CFG.padded_vocab(T)
    for sp in (False, True):
        shapes = re.findall(r"\[([0-9,]+)\]", hlo("selective", sp))
        for dims in shapes:
            dims = tuple(int(d) for d in dims.split(","))
            assert not (vocab in dims and S in dims), f"an op holds {dims}: the full [b, s, vocab] logits"
        assert f"[{B},{S},{vocab // T}]" in hlo("selective", sp)  # the vocab-sharded logits are there
