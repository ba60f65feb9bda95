"""The pipeline schedules as data: dependencies, op counts, tick counts, bubble and in-flight counts."""

import pytest

from jaxseq import schedule as schedule_command
from jaxseq.config import ConfigError
from jaxseq.parallel import schedule as S

CASES = [("gpipe", 2, 4, 1), ("gpipe", 4, 8, 1), ("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 16, 1),
         ("1f1b", 3, 5, 1), ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2), ("interleaved", 4, 4, 2),
         ("interleaved", 4, 12, 3), ("interleaved", 2, 6, 3), ("1f1b", 8, 8, 1)]


def _make(name, p, m, v):
    return S.Schedule.make(name, p, m, v)


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_every_op_once_and_dependencies_respected(name, p, m, v):
    sched = _make(name, p, m, v)
    when = {}
    for t, row in enumerate(sched.timeline):
        for s, op in enumerate(row):
            if op is not None:
                assert (s, op) not in when
                when[(s, op)] = t
    expected = {(s, S.Op(k, i, c)) for s in range(p) for i in range(m) for c in range(v) for k in "FB"}
    assert set(when) == expected
    for (s, op), t in when.items():
        if op.kind == "F":
            if s > 0:
                assert when[(s - 1, op)] < t
            elif op.chunk > 0:
                assert when[(p - 1, S.Op("F", op.mb, op.chunk - 1))] < t
        else:
            assert when[(s, S.Op("F", op.mb, op.chunk))] < t
            if s < p - 1:
                assert when[(s + 1, op)] < t
            elif op.chunk < v - 1:
                assert when[(0, S.Op("B", op.mb, op.chunk + 1))] < t


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_ticks_and_bubble_match_the_formulas(name, p, m, v):
    sched = _make(name, p, m, v)
    assert sched.ticks == 2 * m * v + 2 * (p - 1) == S.lockstep_ticks(p, m, v)
    assert sched.idle_ticks == 2 * (p - 1)
    paper = (p - 1) / (v * m) if name == "interleaved" else (p - 1) / m
    assert sched.bubble == pytest.approx(paper) and sched.paper_bubble == pytest.approx(paper)
    for s in range(p):  # every stage is busy 2mv ticks
        assert sum(row[s] is not None for row in sched.timeline) == 2 * m * v


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (3, 7)])
def test_1f1b_in_flight_is_p_minus_s_and_gpipe_is_m(p, m):
    one = _make("1f1b", p, m, 1)
    assert [one.in_flight(s) for s in range(p)] == [p - s for s in range(p)]
    assert one.depths["stash"] == p
    gpipe = _make("gpipe", p, m, 1)
    assert [gpipe.in_flight(s) for s in range(p)] == [m] * p


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 12, 3), (2, 8, 4)])
def test_interleaved_stage0_holds_pv_plus_p_minus_1_chunk_inputs(p, m, v):
    sched = _make("interleaved", p, m, v)
    assert sched.in_flight(0) == p * v + p - 1 == sched.depths["stash"]
    # The paper's stage-0 memory in layers' worth: (pv + p − 1) chunks of L/(pv) layers = L(1 + (p−1)/(pv)).
    L = p * v * 3
    assert sched.in_flight(0) * L / (p * v) == pytest.approx(L * (1 + (p - 1) / (p * v)))


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_slot_tables_are_consistent(name, p, m, v):
    """Every F's stash slot is read by its own B; every received value is read from the slot it was written to."""
    sched = _make(name, p, m, v)
    tab, T = sched.tables, sched.ticks
    stash, xs, gs = {}, {}, {}
    for t in range(T):
        for s in range(p):
            kind, key = tab["kind"][t, s], (s, tab["mb"][t, s], tab["chunk"][t, s])
            if kind == S.FORWARD:
                assert 0 <= tab["stash"][t, s] < sched.depths["stash"]
                assert (s, tab["stash"][t, s]) not in stash.values()
                stash[key] = (s, tab["stash"][t, s])
                if tab["first"][t, s]:
                    assert tab["x_slot"][t, s] == -1
                else:
                    assert xs.pop((s, tab["x_slot"][t, s])) == key
                if tab["last"][t, s]:
                    gs[(s, tab["g_slot"][t, s])] = key
            elif kind == S.BACKWARD:
                assert stash.pop(key) == (s, tab["stash"][t, s])
                assert gs.pop((s, tab["g_slot"][t, s])) == key
        for s in range(p):  # what arrives after tick t
            for field, buf, depth in (("recv_x", xs, "x"), ("recv_g", gs, "g")):
                slot = tab[field][t, s]
                if slot >= 0:
                    assert slot < sched.depths[depth] and (s, slot) not in buf
                    src = (s - 1) % p if field == "recv_x" else (s + 1) % p
                    mb, chunk = tab["mb"][t, src], tab["chunk"][t, src]
                    chunk += (1 if src == p - 1 else 0) if field == "recv_x" else (-1 if src == 0 else 0)
                    buf[(s, slot)] = (s, mb, chunk)
    assert not stash and not xs and not gs


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_forward_only_runs_the_forwards_in_order_with_no_stash(name, p, m, v):
    """Evaluation's schedule: every forward once, each after the one it depends on, in the training
    schedule's forward order; stage 0 never waits (mv + p − 1 ticks) and nothing is stashed or sent back."""
    sched = S.Schedule.make(name, p, m, v, forward_only=True)
    full = _make(name, p, m, v)
    for s in range(p):
        ran = [row[s] for row in sched.timeline if row[s] is not None]
        assert ran == [op for op in full.order(s) if op.kind == "F"]
    when = {(s, op): t for t, row in enumerate(sched.timeline) for s, op in enumerate(row) if op is not None}
    for (s, op), t in when.items():
        if s > 0:
            assert when[(s - 1, op)] < t
        elif op.chunk > 0:
            assert when[(p - 1, S.Op("F", op.mb, op.chunk - 1))] < t
    assert sched.ticks == m * v + p - 1 and sched.busy_ticks == m * v
    assert sched.depths["stash"] == sched.depths["g"] == 0 and sched.in_flight(0) == 0
    assert (sched.tables["kind"] != S.BACKWARD).all() and (sched.tables["stash"] == -1).all()


@pytest.mark.parametrize("args,message", [
    (("1f1b", 4, 2, 1, 8), "fewer than pipe=4"),
    (("interleaved", 4, 6, 2, 16), "not a multiple of pipe=4"),
    (("zb-h1", 4, 6, 2, 16), r"not a multiple of pipe=4 \(zb-h1 with virtual_stages=2 needs m % p == 0\)"),
    (("1f1b", 2, 4, 1, 3), "layers=3 is not divisible by pipe×virtual_stages = 2×1"),
    (("interleaved", 2, 4, 2, 6), "layers=6 is not divisible by pipe×virtual_stages = 2×2"),
    (("gpipe", 2, 4, 2, 8), "needs the interleaved schedule"),
    (("zb", 2, 4, 1, 8), "schedule='zb' is not valid"),
])
def test_bad_pipelines_are_one_line_errors(args, message):
    with pytest.raises(ConfigError, match=message) as e:
        S.Schedule.make(*args)
    assert "\n" not in str(e.value)


def test_1f1b_with_virtual_stages_is_interleaved():
    assert S.Schedule.make("1f1b", 2, 4, 2).name == "interleaved"


def test_cli_prints_timeline_and_bubble(capsys):
    assert schedule_command.main(["--pipe", "4", "--microbatches", "8", "--virtual-stages", "2"]) == 0
    out = capsys.readouterr().out
    assert "bubble idle/busy = 0.1875 vs the paper's (p−1)/(v·m) = 0.1875" in out
    assert "ticks 38" in out and out.count("stage ") >= 4
    assert schedule_command.main(["--pipe", "4", "--microbatches", "6", "--virtual-stages", "2"]) == 2
    assert capsys.readouterr().err.startswith("error: microbatches=6")
