"""What XLA's partitioner made of the sharding annotations, read from the compiled HLO."""

import re
from collections import Counter

from jaxseq import hlo as HLO

from compiled import B, H, L, MEMORY_CFG, S, T, hlo

ACTIVATION = B * S * H  # elements of one [b, s, h] activation per device (data = 1)


def activation_collectives(text: str, backward: bool) -> Counter:
    """Kinds of the per-layer collectives that move [b, s, h] activations (parameter-gradient
    reductions, e.g. of sequence-parallel LayerNorm weights, are excluded)."""
    ops = HLO.loop_collectives(text, L, backward)
    return Counter(c.kind for c in ops if c.elements == ACTIVATION and c.group_size == T)


def traffic(text: str, backward: bool) -> float:
    ops = HLO.loop_collectives(text, L, backward)
    return sum(HLO.traffic_bytes(c, 2) for c in ops if c.elements == ACTIVATION and c.group_size == T)


def test_tensor_parallel_all_reduces_activations():
    text = hlo("selective", False)
    assert activation_collectives(text, backward=False) == Counter({"all-reduce": 2})
    assert activation_collectives(text, backward=True) == Counter({"all-reduce": 2})


def test_sequence_parallel_turns_each_all_reduce_into_all_gather_plus_reduce_scatter():
    text = hlo("selective", True)
    assert activation_collectives(text, backward=False) == Counter({"all-gather": 2, "reduce-scatter": 2})
    # The paper's claim: the same bytes on the wire as tensor parallelism's all-reduces.
    assert traffic(text, backward=False) == traffic(hlo("selective", False), backward=False)


def test_sequence_parallel_backward_regathers_the_stored_sharded_inputs():
    """Backward: 2 all-gathers conjugate to the forward reduce-scatters, 2 reduce-scatters conjugate
    to the forward all-gathers, and 2 extra all-gathers that re-gather the sequence-sharded LayerNorm
    outputs SP stores instead of the gathered ones (Megatron-LM does the same): +50% backward traffic
    over TP, the price of storing 2·sbh/t instead of 2·sbh twice per layer."""
    sp = hlo("selective", True)
    assert activation_collectives(sp, backward=True) == Counter({"all-gather": 4, "reduce-scatter": 2})
    assert traffic(sp, backward=True) == 1.5 * traffic(hlo("selective", False), backward=True)


def test_full_recompute_replays_the_forward_collectives_but_the_last():
    """Full recompute replays one forward in backward, except the last row-parallel matmul whose
    output the backward never needs: 3 all-reduces (TP), not 4."""
    assert activation_collectives(hlo("full", False), backward=True) == Counter({"all-reduce": 3})


def _forward_loop_tuple(text: str) -> list:
    comps = HLO.parse_hlo(text)
    loop = next(l for l in HLO.layer_loops(comps, L) if not l.backward)
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
