"""The HLO readers (planning/hlo.py and hlo_*.py) on hand-written HLO text (nothing compiled): device groups in each
form XLA prints them, a loop found by its trip count (not one nested in another of that count), how often each
computation runs, the dot FLOPs a program runs with loops counted × their trip count and a conditional at its dearest
branch, and the bytes its kernels move; and that the readers only read text."""

import ast
import glob
import os

import pytest

from jaxseq.planning import hlo, hlo_collectives, hlo_flops, hlo_kernels, hlo_loops

PROGRAM = """HloModule m

%matmul (x: f32[4,8], w: f32[8,16]) -> f32[4,16] {
  %x = f32[4,8]{1,0} parameter(0)
  %w = f32[8,16]{1,0} parameter(1)
  ROOT %d = f32[4,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%idle (a: (f32[4,8], f32[8,16])) -> f32[4,16] {
  %a = (f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  %zero = f32[] constant(0)
  ROOT %z = f32[4,16]{1,0} broadcast(%zero), dimensions={}
}

%busy (a: (f32[4,8], f32[8,16])) -> f32[4,16] {
  %a = (f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  %x = f32[4,8]{1,0} get-tuple-element(%a), index=0
  %w = f32[8,16]{1,0} get-tuple-element(%a), index=1
  ROOT %f = f32[4,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%matmul
}

%body (p: (s32[], f32[4,8], f32[8,16])) -> (s32[], f32[4,8], f32[8,16]) {
  %p = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %w = f32[8,16]{1,0} get-tuple-element(%p), index=2
  %xw = (f32[4,8]{1,0}, f32[8,16]{1,0}) tuple(%x, %w)
  %c = f32[4,16]{1,0} conditional(%i, %xw, %xw), branch_computations={%idle, %busy}
  ROOT %t = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) tuple(%i, %x, %w)
}

ENTRY %main (init: (s32[], f32[4,8], f32[8,16])) -> f32[4,16] {
  %init = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  %loop = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) while(%init), body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %x = f32[4,8]{1,0} get-tuple-element(%loop), index=1
  %w = f32[8,16]{1,0} get-tuple-element(%loop), index=2
  ROOT %d = f32[4,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
ONE_DOT = 2 * 4 * 16 * 8  # 2 × output elements × contracted size


def test_dot_flops_counts_a_loop_by_its_trip_count_and_a_conditional_at_its_dearest_branch():
    comps = hlo.parse_hlo(PROGRAM)
    assert hlo.entry_name(PROGRAM) == "main"
    assert hlo_flops.dot_flops(comps, "busy") == ONE_DOT
    assert hlo_flops.dot_flops(comps, "main") == 3 * ONE_DOT + ONE_DOT


def test_the_loop_with_a_trip_count_and_its_branches():
    comps = hlo.parse_hlo(PROGRAM)
    loop = hlo_loops.while_loop(comps, 3)
    assert (loop.name, loop.trip_count(), loop.attr("body")) == ("loop", 3, "body")
    assert [i.branches() for i in comps["body"] if i.opcode == "conditional"] == [["idle", "busy"]]
    with pytest.raises(ValueError, match="0 while loops with trip count 4"):
        hlo_loops.while_loop(comps, 4)


NESTED = """HloModule n

%tile (p: (s32[], f32[4,8], f32[8,16])) -> (s32[], f32[4,8], f32[8,16]) {
  %p = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %w = f32[8,16]{1,0} get-tuple-element(%p), index=2
  %d = f32[4,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) get-tuple-element(%p)
}

%layer (p: (s32[], f32[4,8], f32[8,16])) -> (s32[], f32[4,8], f32[8,16]) {
  %p = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  ROOT %tiles = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) while(%p), body=%tile, \
backend_config={"known_trip_count":{"n":"2"}}
}

ENTRY %main (init: (s32[], f32[4,8], f32[8,16])) -> (s32[], f32[4,8], f32[8,16]) {
  %init = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  ROOT %layers = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) while(%init), body=%layer, \
backend_config={"known_trip_count":{"n":"2"}}
}
"""


def test_a_loop_nested_in_one_of_the_same_trip_count_is_part_of_its_body():
    """A scan of 2 query tiles inside a layer loop of 2 (the ring's, at MEASURE_LAYERS = 2) is not a second layer
    loop, nor a second loop of that trip count; its dots run 2 × 2 times."""
    comps = hlo.parse_hlo(NESTED)
    assert [loop.name for loop in hlo_loops.outer_loops(comps, 2)] == ["layers"]
    assert hlo_loops.while_loop(comps, 2).name == "layers"
    assert [loop.name for loop in hlo_loops.layer_loops(comps, 2)] == ["layers"]
    assert hlo_flops.program_dot_flops(NESTED) == 4 * ONE_DOT


def test_runs_per_call_multiplies_a_loop_body_by_its_trip_count():
    runs = hlo_loops.runs_per_call(PROGRAM)
    assert runs == {"main": 1, "body": 3, "idle": 3, "busy": 3, "matmul": 3}


ROWS, COLUMNS = [(0, 1, 2, 3), (4, 5, 6, 7)], [(0, 4), (1, 5), (2, 6), (3, 7)]


@pytest.mark.parametrize("attribute, groups", [
    ("replica_groups={{0,2},{1,3}}", [(0, 2), (1, 3)]),
    ("replica_groups=[2,4]<=[8]", ROWS),
    ("replica_groups=[4,2]<=[2,4]T(1,0)", COLUMNS),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", ROWS),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", COLUMNS),
    ("replica_groups=mesh['a'=2,'b'=2], device_ids=([2,2]T(1,0)) {'b'}", [(0, 2), (1, 3)]),
    # XLA 0.12's sub-axes: 'axis_1':(pre-size)size, here the minor and the major pair of the 4 (K/V heads repeated)
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1':(2)2}", [(0, 1), (2, 3), (4, 5), (6, 7)]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1':(1)2}", [(0, 2), (1, 3), (4, 6), (5, 7)]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0', 'axis_1':(1)2}", [(0, 2, 4, 6), (1, 3, 5, 7)]),
    ("source_target_pairs={{0,1},{1,0}}", None),
])
def test_replica_groups_in_every_form_and_the_group_size_they_give(attribute, groups):
    assert hlo_collectives.replica_groups(attribute + ", to_apply=%add") == groups
    # The group size the collectives readers filter by is the same reading's.
    text = ("ENTRY %main (p: f32[2,8]) -> f32[8,8] {\n  %p = f32[2,8]{1,0} parameter(0)\n"
            f"  ROOT %g = f32[8,8]{{1,0}} all-gather(%p), channel_id=1, {attribute}, dimensions={{0}}\n}}\n")
    size = len(groups[0]) if groups else 1
    assert [g.dims for g in hlo_collectives.all_gathers(text, size)] == [(8, 8)]


def test_an_asynchronous_gpu_collective_is_read_by_its_results():
    """XLA:GPU prints an all-gather-start or reduce-scatter-start with the tuple (operands, results) as its shape
    (several operands where its combiner merged collectives); the collective's buffers are the results only."""
    lines = [
        "%ag = (bf16[32,64]{1,0}, bf16[64,64]{1,0}) all-gather-start(%x), channel_id=1, replica_groups={{0,1}}",
        "%rs = ((bf16[1,64,64]{2,0,1}), bf16[1,32,64]{2,0,1}) reduce-scatter-start(%y), replica_groups={{0,1}}",
        "%ag.3 = ((bf16[32,64]{1,0}, bf16[32,64]{1,0}), (bf16[64,64]{1,0}, bf16[64,64]{1,0})) all-gather-start(%a, %b)",
        "%ar = f32[64]{0} all-reduce-start(%z), replica_groups={{0,1}}",
    ]
    text = ("HloModule m\n\nENTRY %main (x: bf16[32,64]) -> bf16[64,64] {\n" + "\n".join("  " + l for l in lines)
            + "\n}\n")
    (instrs,) = hlo.parse_hlo(text).values()
    assert [i.results() for i in instrs] == [
        [("bf16", (64, 64))], [("bf16", (1, 32, 64))], [("bf16", (64, 64)), ("bf16", (64, 64))], [("f32", (64,))]]


STACKING = """HloModule stacking

%store (stack: bf16[3,4,8], x: bf16[4,8], i: s32[]) -> bf16[3,4,8] {
  %stack = bf16[3,4,8]{2,1,0} parameter(0)
  %x = bf16[4,8]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %zero = s32[] constant(0)
  %row = bf16[1,4,8]{2,1,0} reshape(%x)
  ROOT %dus = bf16[3,4,8]{2,1,0} dynamic-update-slice(%stack, %row, %i, %zero, %zero)
}

%load (stack: bf16[3,4,8], i: s32[]) -> bf16[4,8] {
  %stack = bf16[3,4,8]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %zero = s32[] constant(0)
  %slice = bf16[1,4,8]{2,1,0} dynamic-slice(%stack, %i, %zero, %zero), dynamic_slice_sizes={1,4,8}
  ROOT %row = bf16[4,8]{1,0} reshape(%slice)
}

%zeros () -> bf16[3,4,8] {
  %c = bf16[] constant(0)
  ROOT %b = bf16[3,4,8]{2,1,0} broadcast(%c), dimensions={}
}

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], bf16[3,4,8], bf16[4,8])) -> (s32[], bf16[3,4,8], bf16[4,8]) {
  %p = (s32[], bf16[3,4,8]{2,1,0}, bf16[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %stack = bf16[3,4,8]{2,1,0} get-tuple-element(%p), index=1
  %x = bf16[4,8]{1,0} get-tuple-element(%p), index=2
  %stored = bf16[3,4,8]{2,1,0} fusion(%stack, %x, %i), kind=kLoop, calls=%store
  %back = bf16[4,8]{1,0} fusion(%stored, %i), kind=kLoop, calls=%load
  ROOT %t = (s32[], bf16[3,4,8]{2,1,0}, bf16[4,8]{1,0}) tuple(%i, %stored, %back)
}

ENTRY %main (x: bf16[4,8]) -> f32[] {
  %x = bf16[4,8]{1,0} parameter(0)
  %i = s32[] constant(0)
  %stack = bf16[3,4,8]{2,1,0} fusion(), kind=kLoop, calls=%zeros
  %init = (s32[], bf16[3,4,8]{2,1,0}, bf16[4,8]{1,0}) tuple(%i, %stack, %x)
  %loop = (s32[], bf16[3,4,8]{2,1,0}, bf16[4,8]{1,0}) while(%init), body=%body, \
backend_config={"known_trip_count":{"n":"3"}}
  %out = bf16[4,8]{1,0} get-tuple-element(%loop), index=2
  %wide = f32[4,8]{1,0} convert(%out)
  %zero = f32[] constant(0)
  ROOT %total = f32[] reduce(%wide, %zero), dimensions={0,1}, to_apply=%sum
}
"""
ROW = 2 * 4 * 8  # one bf16 [4, 8] row: what a layer stores


def test_kernel_bytes_reads_slices_and_writes_updates_of_a_stack():
    """A loop that stores a row into a stacked buffer (dynamic-update-slice in place: reads the row and the 4-byte
    index, writes the row) and loads one (dynamic-slice: the same) moves 4 rows and 2 indices a trip, 3 trips;
    filling the stack with zeros writes all of it (a broadcast: "copy/transpose" to `op_kinds`); a convert reads
    bf16 and writes f32; a reduce reads f32 and its initial value and writes a scalar (its lambda is its own code,
    no computation of the program's)."""
    moved = hlo_kernels.kernel_bytes(STACKING)
    assert moved == {"body": {"other": 3 * (4 * ROW + 2 * 4)},
                     "main": {"copy/transpose": 3 * ROW, "convert": ROW + 2 * ROW, "other": 2 * ROW + 4 + 4}}
    # jax 0.12's XLA:GPU runs the stack's update asynchronously: the same bytes, from the fusion-start alone, and the
    # same stack a layer stores
    asynchronous = STACKING.replace(
        "%stored = bf16[3,4,8]{2,1,0} fusion(%stack, %x, %i), kind=kLoop, calls=%store",
        "%start = ((bf16[3,4,8]{2,1,0}, bf16[4,8]{1,0}, s32[]), bf16[3,4,8]{2,1,0}, u32[]) "
        "fusion-start(%stack, %x, %i), "
        "kind=kLoop, calls=%store\n  %stored = bf16[3,4,8]{2,1,0} fusion-done(%start)")
    assert "fusion-done" in asynchronous and hlo_kernels.kernel_bytes(asynchronous) == moved
    assert hlo_loops.stored_bytes_per_layer(asynchronous, 3) == hlo_loops.stored_bytes_per_layer(STACKING, 3) == ROW


SPLITTING = """HloModule splitting

%layer_one (stack: bf16[3,4,8]) -> bf16[4,8] {
  %stack = bf16[3,4,8]{2,1,0} parameter(0)
  %slice = bf16[1,4,8]{2,1,0} slice(%stack), slice={[1:2], [0:4], [0:8]}
  ROOT %row = bf16[4,8]{1,0} reshape(%slice)
}

ENTRY %main (stack: bf16[3,4,8]) -> bf16[4,8] {
  %stack = bf16[3,4,8]{2,1,0} parameter(0)
  ROOT %one = bf16[4,8]{1,0} fusion(%stack), kind=kLoop, calls=%layer_one
}
"""


def test_a_fusion_that_slices_a_parameter_reads_the_slice():
    """A static slice (a layer's weights taken from their stack, under unrolled layers) reads one row of the three,
    as a dynamic slice does; read whole, the stacked bf16 copy a probe carried in the train state priced 64.9 GB a
    step above what its kernels read."""
    assert hlo_kernels.kernel_bytes(SPLITTING) == {"main": {"other": ROW + ROW}}


def test_the_h100s_own_program_reads_as_the_one_compiled_for_it_without_a_gpu():
    """The optimized program XLA:GPU compiled on an H100 (JAX 0.11.2, GEMMs autotuned: cuBLAS custom calls among
    them) for gpt3-1.3b's `none` step at micro-batch 4 (experiments/results/gpu_h100_2026-11-27/scan_none.hlo.gz)
    reads as the program compiled for the H100 on a CPU-only machine (experiments/gpu_target.py, recorded in
    gpu_target_vs_measured.json): the same stored bytes per layer, dot FLOPs (cuBLAS's GEMMs counted from their
    dimension numbers) and bytes its memory-bound kernels move, to the byte. Unrolled (`model.unstack`), the H100's
    program moves the 89.1 GB less that experiments/scan_stacks.py priced, with the same dot FLOPs."""
    import gzip
    import json
    from pathlib import Path

    results = Path(__file__).resolve().parents[1] / "experiments" / "results"
    read = lambda name: gzip.open(results / "gpu_h100_2026-11-27" / f"{name}.hlo.gz", "rt").read()
    offline = next(r for r in json.loads((results / "gpu_target_vs_measured.json").read_text())["remat"]
                   if (r["model"], r["remat"]) == ("gpt3-1.3b", "none"))
    scan, unrolled = read("scan_none"), read("unrolled_none_split")
    assert hlo.CUBLAS in scan
    flops = [hlo_flops.program_dot_flops(t) for t in (scan, unrolled)]
    assert flops[0] == flops[1] == pytest.approx(offline["dot_tflop"] * 1e12, rel=1e-9)
    assert hlo_loops.stored_bytes_per_layer(scan, 24) == offline["stored_bytes_per_layer"]
    assert hlo_kernels.memory_bound_bytes(scan) == sum(offline["non_gemm_bytes"].values())
    stack_bytes = hlo_kernels.memory_bound_bytes(scan) - hlo_kernels.memory_bound_bytes(unrolled)
    assert stack_bytes / 1e9 == pytest.approx(89.1, abs=0.05)


# What a reader of HLO text needs: the standard library's text and record tools, numpy for sizes and device ids, and
# its sibling readers (tests/test_architecture.py holds which).
TEXT_READING = {"__future__", "dataclasses", "re", "numpy", "jaxseq"}


def test_the_readers_read_text_and_compile_nothing():
    """planning/hlo*.py read a compiled program's text and neither compile nor touch files: none imports JAX, the
    file system or a temporary directory. A compile that dumps the partitioner's program and flips a global JAX setting
    (`compile_partitioned`) lives with the analysis compiles, in training/aot.py."""
    readers = sorted(glob.glob(os.path.join(os.path.dirname(hlo.__file__), "hlo*.py")))
    imported = {}
    for path in readers:
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        names = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        names |= {node.module.split(".")[0] for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
        imported[os.path.basename(path)] = names
    assert "hlo.py" in imported
    assert {name: sorted(names - TEXT_READING) for name, names in imported.items() if names - TEXT_READING} == {}
