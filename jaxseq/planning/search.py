"""`python -m jaxseq.plan --search`: choose the 3D configuration for a cluster before renting it.

Enumerates every valid (t, p, v, c, d, f, micro-batch b, remat policy, SP, distributed optimizer, and at c > 1
the context strategy) for G GPUs and a global batch B (`planning.search_space`), predicts each one's memory per
device (the first pipeline stage: `planning.search_memory`) and time per step (`planning.search_time`), drops
those over the memory budget, and ranks the rest by predicted time; with `--block-recompute` it adds Megatron-LM's
block recompute where a configuration fits only under `full` (`least_blocks`); with `--target --verify N` it holds
the ranking's first N to their whole train step compiled for the GPU (`verify`). The output, text and JSON, is
`planning.search_report`'s.

FSDP (`--fsdp-sizes`, default 1): a mesh's G/(t·p·c) data-parallel ranks split d × f, f FSDP ranks (f dividing
the hidden size); the batch's rows over d·f, m = B/(d·f·b).

Validity: t divides the GPUs of a node (tensor parallelism stays on NVLink) and the heads, and divides the
K/V heads or is a multiple of them (grouped-query attention: split, or each repeated t/kv_heads times);
t·p·c·d = G with c from `--context-sizes` (context parallelism: c divides the sequence into 2c chunks; either
strategy, under a pipeline too);
p·v divides the layers; d·b divides B, m = B/(d·b) micro-batches per step; with p > 1, m ≥ p, and the
interleaved schedule (v > 1) needs m % p == 0 (`config.validate_pipeline`). SP needs t > 1, the
distributed optimizer d > 1. v > 1 means Megatron's interleaved 1F1B, v = 1 plain 1F1B (GPipe holds
m micro-batches for the same bubble, so it never wins and is not enumerated).

The measuring lives in `planning.search_costs` (`SearchCosts`, the `costs.Costs` the search reads); this module
and the two models are arithmetic on what it returns.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from jaxseq.config import ConfigError, ModelConfig, replace
from jaxseq.models.formulas import train_flops
from jaxseq.planning import search_offload, search_space
from jaxseq.planning.blocks import Block, fewest
from jaxseq.planning.costs import Costs, at_context, chunk_layers, costs_of, run_kernels
from jaxseq.planning.search_memory import Memory, block_memory, memory
from jaxseq.planning.search_space import (GIB, Candidate, FamilyReason, Request, enumerate_candidates, families,
                                          family_reason)
from jaxseq.planning.search_time import Time, block_time, program_step_time, step_time
from jaxseq.remat import block_spec


@dataclass(frozen=True)
class Evaluated:
    candidate: Candidate
    memory: Memory
    time: Time
    model_tflops_per_gpu: float  # model FLOPs per step (no recompute) / step time / GPUs
    mfu: float
    fits: bool
    layer_context: int = 1  # the context size its layer was compiled at (< c: scaled by `at_context`)
    compiled_bytes: int | None = None  # its whole train step's peak per device, compiled for the target (`verify`)
    compiled_step_s: float | None = None  # its step time priced on that program (`program_step_time`; p = 1 only)

    @property
    def layer_source(self) -> str:
        """Whether its layer's memory and TP collectives were compiled at its c or scaled from c = 1."""
        return "compiled" if self.layer_context == self.candidate.context else "scaled"

    def to_json(self, moe: bool = False) -> dict:
        """JSON-ready; `moe` (a mixture searched): its expert size and all-to-all time too (a dense model's rows
        carry neither)."""
        c, mem, t = self.candidate, self.memory, self.time
        fields = {k: v for k, v in asdict(c).items() if moe or k != "expert"}
        a2a = {"all_to_all": t.expert_s} if moe else {}
        return {**fields, "schedule": c.schedule,
                "memory_gib": {"total": mem.total_bytes / GIB, "state": mem.state_bytes / GIB,
                               "activations": mem.activation_bytes / GIB, "working": mem.working_bytes / GIB,
                               "w_stash": mem.deferred_stash_bytes / GIB,
                               "fsdp_gathered": mem.fsdp_gathered_bytes / GIB,
                               "accumulator": mem.accumulator_bytes / GIB,
                               "accumulation_held_copy": mem.held_copy_bytes / GIB,
                               "in_flight_layers": mem.in_flight_layers,
                               "pipeline_executor": {k: v / GIB for k, v in asdict(mem.executor).items()}},
                "time_s": {"total": t.total_s, "compute": t.compute_s, "tensor_collectives": t.tp_s,
                           "pipeline_p2p": t.p2p_s, "bubble": t.bubble_s, "data_parallel": t.dp_s,
                           "context_kv": t.context_s, "optimizer_update": t.optimizer_s,
                           "fsdp_gather_scatter": t.fsdp_s, "pcie": t.pcie_s, **a2a},
                "host_gib": mem.host_bytes / GIB,
                "bubble": t.bubble, "model_tflops_per_gpu": self.model_tflops_per_gpu, "mfu": self.mfu,
                "fits": self.fits, "layer": self.layer_source, "layer_compiled_at_context": self.layer_context,
                "compiled_step_gib": None if self.compiled_bytes is None else self.compiled_bytes / GIB,
                "compiled_step_s": self.compiled_step_s}


def evaluate(cfg: ModelConfig, r: Request, c: Candidate, costs: Costs) -> Evaluated:
    layer, state = costs_of(cfg, c, costs)
    t = step_time(cfg, c, layer, state, r.hardware, r.time_model)
    return evaluate_at(cfg, r, c, memory(cfg, c, layer, state), t, layer.context)


def evaluate_at(cfg: ModelConfig, r: Request, c: Candidate, mem: Memory, t: Time, layer_context: int) -> Evaluated:
    """Candidate c evaluated at its memory and step time: its model TFLOP/s per GPU and MFU, and whether it fits."""
    tflops = train_flops(cfg, r.global_batch) / t.total_s / r.gpus / 1e12
    return Evaluated(c, mem, t, tflops, tflops / r.hardware.peak_tflops, mem.total_bytes <= r.budget_bytes,
                     layer_context)


# ---------------------------------------------------------------------------------------------
# The search


@dataclass
class Result:
    model: str
    config: ModelConfig
    request: Request
    ranked: list[Evaluated]  # those that fit, fastest first
    evaluated: int
    rejected_families: list[dict] = field(default_factory=list)  # {"tensor", "pipe", "data", "rule", "reason"}
    # layers measured: distinct (t, SP, remat, attention, and where compiled at c > 1, c and strategy)
    compiled: int = 0
    target: str | None = None  # the GPU the layers were compiled for (`plan --search --target`), else XLA:CPU
    over_budget: list[Evaluated] = field(default_factory=list)  # fit by the parts, not by the compiled step (`verify`)

    def rank_of(self, match) -> int | None:
        """1-based rank of the first fitting configuration `match(candidate)` accepts, or None."""
        return next((i + 1 for i, e in enumerate(self.ranked) if match(e.candidate)), None)


def search(cfg: ModelConfig, r: Request, costs: Costs, model: str = "custom", target: str | None = None) -> Result:
    """Every valid configuration, evaluated; ConfigError (one line) when none fits."""
    search_space.validate_request(cfg, r)
    candidates = enumerate_candidates(cfg, r)
    reasons = {f: family_reason(cfg, r, *f) for f in families(cfg, r)}
    if not candidates:
        raise ConfigError(f"no valid configuration of {r.gpus} GPUs for {model}: "
                          + "; ".join(sorted({str(why) for why in reasons.values() if why})[:3]))
    keys = sorted({(c.tensor, c.sequence_parallel, c.remat, c.context, c.context_strategy, *((True,) if c.fp8 else ()))
                   for c in candidates})
    costs.prepare(keys, r.micro_batches)
    evaluated = [evaluate(cfg, r, c, costs) for c in candidates]
    if r.block_recompute:
        evaluated += least_blocks(cfg, r, evaluated, costs)
    if r.offload or r.offload_optimizer:
        evaluated += search_offload.offloaded(cfg, r, evaluated, costs, evaluate_at)
    ranked = sorted((e for e in evaluated if e.fits),
                    key=lambda e: (e.time.total_s, e.memory.total_bytes, e.candidate))
    rejected = []
    for f, reason in reasons.items():
        if reason is None:
            fam = [e for e in evaluated if e.candidate.mesh_family == f]
            if any(e.fits for e in fam):
                continue
            reason = sizes_reason(r, f) if not fam else over_memory(r, fam)
        rejected.append({"tensor": f[0], "pipe": f[1], "data": r.gpus // (f[0] * f[1]), "rule": reason.rule,
                         "reason": reason.text})
    if not ranked:
        least = min(evaluated, key=lambda e: e.memory.total_bytes)
        raise ConfigError(f"no configuration of {model} fits in {r.hardware.memory_gib:g} GiB per GPU on {r.gpus} "
                          f"GPUs: the least memory is {least.memory.total_bytes / GIB:.1f} GiB "
                          f"({least.candidate.label()})")
    measured = {(e.candidate.tensor, e.candidate.sequence_parallel, e.candidate.remat, e.layer_context,
                 e.candidate.context_strategy if e.layer_context > 1 else "", run_kernels(cfg, e.candidate).attention,
                 e.candidate.fp8)
                for e in evaluated if block_spec(e.candidate.remat) is None}
    return Result(model, cfg, r, ranked, len(evaluated), rejected, len(measured), target)


def sizes_reason(r: Request, family: tuple[int, int]) -> FamilyReason:
    """Why a mesh family that breaks no rule of its own has no candidate: the sizes asked do not split it."""
    ranks = r.gpus // (family[0] * family[1])
    return FamilyReason("sizes", f"no FSDP size of {list(r.fsdp_sizes)} and micro-batch of {list(r.micro_batches)} "
                                 f"splits its {ranks} data ranks and the global batch {r.global_batch}")


def over_memory(r: Request, family: list[Evaluated]) -> FamilyReason:
    """A mesh family none of whose configurations fits: its least memory against the budget."""
    least = min(family, key=lambda e: e.memory.total_bytes)
    return FamilyReason("memory", f"over memory: least {least.memory.total_bytes / GIB:.1f} GiB > "
                                  f"{r.hardware.memory_gib:g} GiB ({least.candidate.label()})")


def verify(res: Result, count: int, step_costs, costs: Costs) -> Result:
    """The ranking's first `count` configurations held to their whole train step compiled for the target
    (`step_costs(candidate)`: the GPU program's peak per device, where the ranking added parts up: the state's share
    of the peak + stored × layers + working; and what its memory-bound kernels move, which prices its step time
    where there is no pipeline: `search_time.program_step_time`; both against the H100's measured peaks and steps
    in experiments/results/gpu_target_vs_measured.md). One whose step does not fit the budget leaves the ranking
    (`over_budget`) and the next is verified in its place, until `count` fit or the ranking ends. A new Result:
    `res` is left as it was."""
    kept, over, verified = [], list(res.over_budget), 0
    r = res.request
    for e in res.ranked:
        if verified < count:
            compiled_bytes, moved = step_costs(e.candidate)
            seconds = None
            if e.candidate.pipe == 1 and moved is not None:
                seconds = sum(w * program_step_time(res.config, c, *costs_of(res.config, c, costs), r.hardware,
                                                    r.time_model, moved).total_s
                              for c, w in policy_weights(res.config, e.candidate))
            e = replace(e, compiled_bytes=compiled_bytes, compiled_step_s=seconds)
            if e.compiled_bytes > res.request.budget_bytes:
                over.append(replace(e, fits=False))
                continue
            verified += 1
        kept.append(e)
    if not kept:
        raise ConfigError(f"no configuration of {res.model} fits in {res.request.hardware.memory_gib:g} GiB per GPU "
                          f"by its train step compiled for the {res.target}: the least is "
                          f"{min(e.compiled_bytes for e in over) / GIB:.1f} GiB")
    return replace(res, ranked=kept, over_budget=over)


# ---------------------------------------------------------------------------------------------
# Block recompute (`Request.block_recompute`): Megatron-LM's --recompute-method block, between a policy and full


def policy_weights(cfg: ModelConfig, c: Candidate) -> list[tuple[Candidate, float]]:
    """Candidate c as its plain policies, each with its share of a chunk's layers: [(c, 1)] for a plain policy;
    for a block spec (`remat.block_spec`) its first policy's n/k and its rest's (k − n)/k."""
    block = block_spec(c.remat)
    if block is None:
        return [(c, 1.0)]
    first, n, rest = block
    weight = Block(n, chunk_layers(cfg, c)).weight
    return [(replace(c, remat=first), weight), (replace(c, remat=rest), 1 - weight)]


def least_blocks(cfg: ModelConfig, r: Request, evaluated: list[Evaluated], costs: Costs) -> list[Evaluated]:
    """For each configuration that does not fit under a policy that recomputes less than `full`, where the same
    configuration under `full` fits: Megatron's block recompute with the fewest `full` layers per chunk that fits,
    composed from the two (`blocks.Block`, as the plan composes its rows)."""
    by_candidate = {e.candidate: e for e in evaluated}
    out = []
    for e in evaluated:
        c = e.candidate
        full = by_candidate.get(replace(c, remat="full"))
        k = chunk_layers(cfg, c)
        if e.fits or c.remat == "full" or full is None or not full.fits or k < 2:
            continue
        stored = at_context(run_kernels(cfg, c), c, costs_of(cfg, c, costs)[0]).stored_bytes
        compose = lambda n: evaluate_at(cfg, r, replace(c, remat=Block(n, k).spec("full", c.remat)),
                                        block_memory(e.memory, full.memory, stored, n, k),
                                        block_time(e.time, full.time, n, k), e.layer_context)
        block = fewest(k, compose, lambda composed: composed.fits)
        if block is not None:
            out.append(block)
    return out


# ---------------------------------------------------------------------------------------------
# Reading the command line


def parse_list(text: str, kind=int) -> tuple:
    try:
        return tuple(kind(x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{text!r} is not a comma-separated list of {kind.__name__}") from None
