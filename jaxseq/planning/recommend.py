"""--budget-gib: the configuration of a plan with the least recompute that fits, and Megatron-LM's block recompute
composed from two of its rows (`block_row`) where a policy misses the budget and `full` fits."""

from __future__ import annotations

import dataclasses

from jaxseq.planning import gpu_target
from jaxseq.planning.blocks import Block, fewest
from jaxseq.planning.memory import GIB
from jaxseq.planning.plan import Plan, Row
from jaxseq.remat import POLICIES, block_spec


def chunk_layers(p: Plan) -> int:
    """Layers in each pipeline chunk (L/(p·v)): where a block spec counts its N, as Megatron-LM does."""
    return p.config.layers // (p.pipeline * p.virtual_stages)


def block_row(p: Plan, first: Row, rest: Row, n: int) -> Row:
    """Megatron-LM's block recompute, composed from two rows of one (t, SP) as the search composes its candidates
    (`blocks.Block`): the first n layers of each chunk of k (`chunk_layers`) under `first`'s policy, the other k − n
    under `rest`'s. Per layer, stored bytes, FLOPs and collectives are n/k of the way from rest's to first's, and so
    are the activations; its total and working memory are the larger backward loop's: each row's total with its
    activations replaced by those the loop holds. Against the step compiled for the H100 and by XLA:CPU:
    tests/test_block_recompute.py."""
    block = Block(n, chunk_layers(p))
    activations = block.mix(first.activation_bytes_per_device, rest.activation_bytes_per_device)
    # each loop: its row's total with the activations it holds in place of the row's own, and its working memory
    total, working = block.peak(
        lambda held: (rest.total_bytes_per_device - (rest.activation_bytes_per_device - held),
                      rest.working_bytes_per_device),
        lambda held: (first.total_bytes_per_device - (first.activation_bytes_per_device - held),
                      first.working_bytes_per_device),
        activations, rest.measured_bytes_per_layer, lambda loop: loop[0])
    formula = (block.mix(first.formula_bytes_per_layer, rest.formula_bytes_per_layer)
               if first.formula_bytes_per_layer and rest.formula_bytes_per_layer else None)
    stored = block.mix(first.measured_bytes_per_layer, rest.measured_bytes_per_layer)
    collectives = block.mix(first.collectives, rest.collectives)
    return dataclasses.replace(
        rest, config=f"{rest.config} + {first.remat}:{n}", remat=block.spec(first.remat, rest.remat),
        measured_bytes_per_layer=stored, formula_bytes_per_layer=formula, ratio=stored / formula if formula else None,
        flops_per_layer=block.mix(first.flops_per_layer, rest.flops_per_layer),
        recompute_overhead_pct=block.mix(first.recompute_overhead_pct, rest.recompute_overhead_pct),
        collective_bytes_per_layer=sum(collectives.values()), collectives=collectives,
        activation_bytes_per_device=activations, working_bytes_per_device=working,
        total_bytes_per_device=total, host_bytes_per_device=block.mix(first.host_bytes_per_device,
                                                                      rest.host_bytes_per_device),
        pcie_bytes_per_step=block.mix(first.pcie_bytes_per_step, rest.pcie_bytes_per_step),
        pcie_seconds_per_step=block.mix(first.pcie_seconds_per_step, rest.pcie_seconds_per_step),
        memory_source=f"composed from the rows {first.config} and {rest.config} (recommend.block_row), theirs from "
                      f"{rest.memory_source.split(' (')[0]}")


def least_block_rows(p: Plan, budget_bytes: float) -> list[Row]:
    """For each row on `p.tensor` devices that recomputes less than `full` at its SP and does not fit: its block
    recompute with the fewest `full` layers per chunk that fits (`block_row`), where one does short of full."""
    full = {r.sequence_parallel: r for r in p.rows if r.tensor == p.tensor and r.remat == "full"}
    out = []
    for rest in p.rows:
        first = full.get(rest.sequence_parallel)
        if (rest.tensor != p.tensor or first is None or rest.total_bytes_per_device <= budget_bytes
                or rest.recompute_overhead_pct >= first.recompute_overhead_pct):
            continue
        fitting = fewest(chunk_layers(p), lambda n: block_row(p, first, rest, n),
                         lambda row: row.total_bytes_per_device <= budget_bytes)
        out += [fitting] if fitting else []
    return out


def compiled_block_bytes(p: Plan, row: Row, target: str, progress=None) -> int:
    """Block row `row` (composed from two rows, `block_row`) compiled as it would run: its whole train step's peak
    per device for GPU `target`, on the plan's full mesh (`gpu_target.step_parallel`, as `on_target` compiles each
    row's)."""
    whole = gpu_target.step_parallel(tensor=row.tensor, sequence_parallel=row.sequence_parallel, data=p.data,
                                     distributed_optimizer=p.distributed_optimizer, pipeline=p.pipeline,
                                     schedule=p.schedule, virtual_stages=p.virtual_stages, context=p.context,
                                     strategy=p.context_strategy, fsdp=p.fsdp)
    if progress is not None:
        progress.compiling(f"{row.remat} for {target}: the whole train step")
    return gpu_target.step_bytes(p.config, whole, row.remat, p.micro_batch, p.microbatches if p.pipeline > 1 else 1,
                                 target)


def replay_rank(remat: str) -> int:
    """What policy (or block spec) `remat` replays in backward, by the policies' definitions (`remat.RematPolicy`):
    0 nothing (`none`); 2 the whole forward but its last matmul (its QKV matmul among the replays: `full`); 1 a part
    of it (every other policy, and a block recompute: some layers under one policy, the others under another)."""
    if block_spec(remat) is not None:
        return 1
    policy = POLICIES[remat]
    if "qkv" in policy.replays:
        return 2
    return 1 if policy.replays or policy.replays_norms else 0


def recommend(p: Plan, budget_bytes: float) -> tuple[Row | None, list[tuple[Row, str]]]:
    """The configuration on `p.tensor` devices with the least recompute that fits, and why each
    cheaper one does not. Order: what the policy replays (`replay_rank`), then the measured recompute overhead,
    then collective bytes (SP's extra backward all-gathers), then memory. The rank comes first because XLA:CPU's
    FLOP count of a replaying policy's program can fall below `none`'s (`dots` with fused attention, for one): a
    count of a differently compiled program, not what the policy replays. Among them Megatron-LM's block recompute of
    the rows that do not fit (`least_block_rows`): the fewest layers per chunk under `full` that make them fit."""
    candidates = sorted([*(r for r in p.rows if r.tensor == p.tensor), *least_block_rows(p, budget_bytes)],
                        key=lambda r: (replay_rank(r.remat), round(r.recompute_overhead_pct, 2),
                                       r.collective_bytes_per_layer, r.total_bytes_per_device))
    rejected = []
    for r in candidates:
        if r.total_bytes_per_device <= budget_bytes:
            return r, rejected
        rejected.append((r, f"{r.total_bytes_per_device / GIB:.1f} GiB > budget {budget_bytes / GIB:.1f} GiB"))
    return None, rejected
