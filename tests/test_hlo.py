"""planning/hlo.py's general readers on hand-written HLO text (nothing compiled): device groups in each
form XLA prints them."""

import pytest

from jaxseq.planning import hlo as HLO

ROWS, COLUMNS = [(0, 1, 2, 3), (4, 5, 6, 7)], [(0, 4), (1, 5), (2, 6), (3, 7)]


@pytest.mark.parametrize("attribute, groups", [
    ("replica_groups={{0,2},{1,3}}", [(0, 2), (1, 3)]),
    ("replica_groups=[2,4]<=[8]", ROWS),
    ("replica_groups=[4,2]<=[2,4]T(1,0)", COLUMNS),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", ROWS),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", COLUMNS),
    ("replica_groups=mesh['a'=2,'b'=2], device_ids=([2,2]T(1,0)) {'b'}", [(0, 2), (1, 3)]),
    ("source_target_pairs={{0,1},{1,0}}", None),
])
def test_replica_groups_in_every_form_and_the_group_size_they_give(attribute, groups):
    assert HLO.replica_groups(attribute + ", to_apply=%add") == groups
    # The group size the collectives readers filter by is the same reading's.
    text = ("ENTRY %main (p: f32[2,8]) -> f32[8,8] {\n  %p = f32[2,8]{1,0} parameter(0)\n"
            f"  ROOT %g = f32[8,8]{{1,0}} all-gather(%p), channel_id=1, {attribute}, dimensions={{0}}\n}}\n")
    size = len(groups[0]) if groups else 1
    assert [g.dims for g in HLO.all_gathers(text, size)] == [(8, 8)]
