"""The pipeline schedule's tick table as the executor reads it: each stage's `TickRow` at each tick (its
`Branch`, micro-batch, chunk and buffer slots), int32, from `schedule.Schedule`'s tables."""

from __future__ import annotations

from enum import IntEnum
from typing import Any, NamedTuple

import numpy as np

from jaxseq.config import ParallelConfig
from jaxseq.parallel import schedule


class Branch(IntEnum):
    """The executor's `lax.switch` branches, by number: the schedule's op kinds (`schedule.IDLE`,
    `FORWARD`, `BACKWARD`, `WEIGHT`) split by what else the op runs. The model's first chunk embeds before its
    forward and runs the embedding's vjp after its backward; the last chunk's forward ends in the loss."""

    IDLE = 0
    FORWARD = 1
    FORWARD_FIRST = 2
    FORWARD_LAST = 3
    BACKWARD = 4
    BACKWARD_FIRST = 5
    WEIGHT = 6  # zb-h1's W: a chunk's deferred weight gradients


class TickRow(NamedTuple):
    """What one stage does at one tick: int32 scalars inside the loop. The schedule's fields
    (`schedule.Schedule.tables`) with the −1s ("does not apply") replaced, so every read and write has a
    target."""

    branch: Any  # the `Branch` to run
    mb: Any  # the op's micro-batch (0 when idle)
    chunk: Any  # the op's chunk on this stage, 0 … v − 1 (0 when idle)
    stash: Any  # the residual slot a forward writes and its backward reads
    w_slot: Any  # the W stash slot a split backward's B writes and its W reads (zb-h1)
    x_slot: Any  # the activation slot a forward reads its input from
    g_slot: Any  # the gradient slot a backward reads (the last chunk's forward writes its loss gradient there)
    recv_x: Any  # where the activation arriving after this tick is written (depth x: the trash slot)
    recv_g: Any  # where the gradient arriving after this tick is written (depth g: the trash slot)

    @staticmethod
    def of(row) -> TickRow:
        """The fields of one row of `tick_rows`' table (int32 [len(FIELDS)])."""
        return TickRow(*(row[i] for i in range(len(FIELDS))))


FIELDS = TickRow._fields


def schedule_of(parallel: ParallelConfig, microbatches: int, layers: int,
                forward_only: bool = False) -> schedule.Schedule:
    return schedule.Schedule.make(parallel.schedule, parallel.pipe, microbatches, parallel.virtual_stages, layers,
                           forward_only)


def branches_of(tables: dict[str, np.ndarray]) -> np.ndarray:
    """[ticks, p]: the `Branch` of each stage at each tick, from the schedule's kind, first and last."""
    kind, first, last = tables["kind"], tables["first"] == 1, tables["last"] == 1
    forward, backward = kind == schedule.FORWARD, kind == schedule.BACKWARD
    return np.select([kind == schedule.IDLE, kind == schedule.WEIGHT, forward & first, forward & last, forward,
                      backward & first],
                     [Branch.IDLE, Branch.WEIGHT, Branch.FORWARD_FIRST, Branch.FORWARD_LAST, Branch.FORWARD,
                      Branch.BACKWARD_FIRST], Branch.BACKWARD)


def tick_rows(sched: schedule.Schedule) -> np.ndarray:
    """[ticks, p, len(FIELDS)] int32: each stage's `TickRow` at each tick, fields in `FIELDS` order.
    Receive slots of −1 become the trash slot (index = depth) so that every write has a target."""
    tab, depth = sched.tables, sched.depths
    row = TickRow(
        branch=branches_of(tab), mb=np.maximum(tab["mb"], 0), chunk=np.maximum(tab["chunk"], 0),
        stash=np.maximum(tab["stash"], 0), w_slot=np.maximum(tab["w_slot"], 0), x_slot=np.maximum(tab["x_slot"], 0),
        g_slot=np.maximum(tab["g_slot"], 0),
        recv_x=np.where(tab["recv_x"] < 0, depth["x"], tab["recv_x"]),
        recv_g=np.where(tab["recv_g"] < 0, depth["g"], tab["recv_g"]),
    )
    return np.stack(row, axis=-1).astype(np.int32)
