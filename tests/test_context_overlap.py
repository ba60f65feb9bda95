"""The ring's sends in the compiled program (experiments/context_overlap.py): how many there are, and which ring
block computations each one depends on, the structure docs/DESIGN.md's "Overlap on a GPU" argument rests on."""

import importlib.util
import os
import sys

import pytest

C = 2  # context size; the tiny preset, tensor 1


def _load_script():
    path = os.path.join(os.path.dirname(__file__), "..", "experiments", "context_overlap.py")
    spec = importlib.util.spec_from_file_location("context_overlap", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["context_overlap"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


CO = _load_script()


@pytest.fixture(scope="module")
def text():
    return CO.compile_ring(C, 1)


@pytest.fixture(scope="module")
def sends(text):
    return CO.ring_sends(text, CO.preset(CO.MODEL).layers)


def test_the_ring_sends_c_minus_1_kv_blocks_forward_and_c_minus_1_plus_c_backward(sends):
    forward = [s.carries for s in sends if not s.backward]
    backward = [s.carries for s in sends if s.backward]
    assert forward == ["K/V"] * 2 * (C - 1)  # K and V: one send each per step but the last
    assert sorted(backward) == ["K/V"] * 2 * (C - 1) + ["dK/dV"] * 2 * C  # dK/dV go the whole way home


def test_no_kv_send_waits_for_a_block_so_it_can_overlap_the_step_it_accompanies(sends):
    """The block sent on is the one just received: no block computation is upstream of it, and the current
    step's blocks (at least the first step's dots) are free to run while it is in flight."""
    for s in sends:
        if s.carries == "K/V":
            assert s.blocks_before == 0 and s.blocks_free > 0
            assert s.blocks_after > 0 and s.into_switch  # the next step (a switch: two patterns) waits for it


def test_no_dk_dv_send_gates_the_next_steps_blocks(sends):
    """Each step's dK/dV are computed from zeros inside its `lax.switch` and added to the arriving accumulators
    after it: no switch takes a dK/dV send as an operand and no block waits for one, so each send can overlap
    the next step's blocks (TransformerEngine's order; experiments/results/context.md)."""
    dkv = [s for s in sends if s.carries == "dK/dV"]
    assert {s.hop for s in dkv} == set(range(1, C + 1))
    assert all(s.blocks_before > 0 for s in dkv)
    assert not [s.hop for s in dkv if s.into_switch or s.blocks_after]


def test_xla_cpu_lowers_the_permutes_synchronously(text):
    """No -start/-done pair on the CPU: its order cannot show overlap, only the dependences can."""
    assert CO.async_pairs(text) == 0 and "collective-permute(" in text
