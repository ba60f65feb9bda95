"""The search space of `plan --search`: what a request asks (the cluster, the global batch, the sizes, policies and
time-model constants to try), validated in one line, and every valid configuration of it (`Candidate`), with the
reason a mesh family (t, p) has none (`FamilyReason`). The rules are in planning/search.py's docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from jaxseq.config import CONTEXT_STRATEGIES, ConfigError, ModelConfig
from jaxseq.hardware import Hardware
from jaxseq.remat import POLICIES

GIB = 2**30


# ---------------------------------------------------------------------------------------------
# The time model's constants (the cluster's: jaxseq/hardware.py)

# Achieved fraction of peak of a GEMM's full wave of tiles (`planning.kernel_time`: the GEMMs' shapes decide
# how many waves they take), calibrated on ONE row: Korthikanti et al. 2022 Table 5, 175B (t = 8, p = 8,
# v = 3, 64 GPUs, batch 64, SP + selective, 13.75 s per iteration); experiments/autoconfig.py recomputes it
# and reports the error on every other row.
COMPUTE_EFFICIENCY = 0.728
# Achieved fraction of HBM bandwidth by memory-bound kernels (stated, not fitted: a read kernel on an A100
# 80 GB SXM measured by Nsight Compute reaches 1.80 of 2.04 TB/s, 88%; NVIDIA developer forum, "Trouble to
# reach peak bandwidth of A100", forums.developer.nvidia.com/t/339083).
MEMORY_EFFICIENCY = 0.88
# Achieved fraction of a link's bandwidth by NCCL rings (stated, not fitted: nccl-tests' bus bandwidth on
# DGX A100 is about 230–240 GB/s of NVLink's 300).
LINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class TimeModel:
    compute_efficiency: float = COMPUTE_EFFICIENCY
    memory_efficiency: float = MEMORY_EFFICIENCY
    link_efficiency: float = LINK_EFFICIENCY
    # FSDP's gathers and reduce-scatters hidden behind the compute of a micro-batch where they fit (charged only
    # beyond it), as MaxText's pipelined, asynchronous gathers are: its Llama 2 70B FSDP=64 step on 64 H100s
    # measured within 5% of the compute alone (experiments/results/fsdp.md). False: nothing overlapped, the bound
    # jaxseq's own program is held to until a GPU measures it.
    fsdp_overlap: bool = False
    # Each tick of the pipeline priced as jaxseq's lock-step executor runs it: the slowest stage's op (F, B, W at a
    # layer's split kernel times: `Schedule.lockstep_bubble`). False: as Megatron's asynchronous stages run, the
    # schedule's idle/busy ticks (ZB-H1: Qi et al.'s formula), the model the calibration and the papers' rows use.
    lockstep: bool = False
    # Each layer's stored activations priced through `lax.scan`'s stacked buffers (`kernel_time.STACK_PASSES`): jaxseq's
    # program. False: Megatron-LM's, which keeps them where its kernels wrote them; the papers' rows measured it
    # (experiments/autoconfig.py calibrates and compares with False).
    scan_stacks: bool = True


# ---------------------------------------------------------------------------------------------
# The request and the candidates


SEARCH_SCHEDULES = ("1f1b", "zb-h1")  # GPipe holds m micro-batches for 1F1B's bubble: never enumerated


@dataclass(frozen=True)
class Request:
    gpus: int
    global_batch: int
    hardware: Hardware
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    remats: tuple[str, ...] = ("none", "selective", "full")
    time_model: TimeModel = TimeModel()
    tensor_sizes: tuple[int, ...] | None = None  # None: every divisor of the GPUs per node
    context_sizes: tuple[int, ...] = (1,)  # c to try (context parallelism: `context_candidates`)
    fsdp_sizes: tuple[int, ...] = (1,)  # F to try: the data-parallel ranks d·F of a mesh split into F FSDP ranks
    schedules: tuple[str, ...] = ("1f1b",)  # 1f1b: 1F1B and, v > 1, interleaved; zb-h1: ZB-H1 too (`SEARCH_SCHEDULES`)
    context_strategies: tuple[str, ...] = CONTEXT_STRATEGIES  # those to try at c > 1 (Megatron-LM's --cp-comm-type)
    # also Megatron-LM's block recompute (`search.least_blocks`): full on the fewest layers per chunk that fit
    block_recompute: bool = False
    # also host offload (`search_offload.offloaded`): what the policy stores in host memory; the optimizer state
    offload: bool = False
    offload_optimizer: bool = False
    fp8: tuple[bool, ...] = (False,)  # the layers' weight GEMMs in bf16 (False) and/or as FP8 GEMMs (True: --fp8)
    expert_sizes: tuple[int, ...] = (1,)  # E to try: a mixture's routed experts split over E of the data ranks

    @property
    def budget_bytes(self) -> float:
        return self.hardware.memory_gib * GIB


def validate_request(cfg: ModelConfig, r: Request) -> None:
    hw = r.hardware
    for name, value in (("gpus", r.gpus), ("global_batch", r.global_batch), ("gpus_per_node", hw.gpus_per_node)):
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{name}={value!r} must be a positive integer")
    for name in ("peak_tflops", "memory_gib", "hbm_gb_per_s", "intra_node_gb_per_s", "inter_node_gbit_per_s"):
        if not getattr(hw, name) > 0:
            raise ConfigError(f"{name}={getattr(hw, name)!r} must be positive")
    if not isinstance(hw.sm_count, int) or hw.sm_count <= 0:
        raise ConfigError(f"sm_count={hw.sm_count!r} must be a positive integer")
    if r.gpus % hw.gpus_per_node and hw.gpus_per_node % r.gpus:
        raise ConfigError(f"gpus={r.gpus} is not a multiple of gpus_per_node={hw.gpus_per_node} "
                          "(nor a part of one node)")
    for b in r.micro_batches:
        if not isinstance(b, int) or b <= 0:
            raise ConfigError(f"micro-batch {b!r} must be a positive integer")
    for remat in r.remats:
        if remat not in POLICIES:
            raise ConfigError(f"remat={remat!r} is not a registered policy; valid: {', '.join(POLICIES)}")
    if r.block_recompute and "full" not in r.remats:
        raise ConfigError(f"block recompute runs some layers under full: add full to the remat policies "
                          f"({','.join(r.remats)})")
    for t in r.tensor_sizes or ():
        if not isinstance(t, int) or t <= 0 or hw.gpus_per_node % t:
            raise ConfigError(f"tensor size {t!r} must divide gpus_per_node={hw.gpus_per_node}")
    for c in r.context_sizes:
        if not isinstance(c, int) or c <= 0:
            raise ConfigError(f"context size {c!r} must be a positive integer")
    for schedule in r.schedules:
        if schedule not in SEARCH_SCHEDULES:
            raise ConfigError(f"schedule {schedule!r} is not searched; valid: {', '.join(SEARCH_SCHEDULES)} (1f1b "
                              "includes the interleaved schedule, v > 1)")
    for strategy in r.context_strategies:
        if strategy not in CONTEXT_STRATEGIES:
            raise ConfigError(f"context strategy {strategy!r} is not known; valid: {', '.join(CONTEXT_STRATEGIES)}")
    if not r.context_strategies:
        raise ConfigError(f"no context strategy to try; valid: {', '.join(CONTEXT_STRATEGIES)}")
    for f in r.fsdp_sizes:
        if not isinstance(f, int) or f <= 0:
            raise ConfigError(f"fsdp size {f!r} must be a positive integer")
    validate_expert_sizes(cfg, r.expert_sizes)
    if True in r.fp8 and not hw.fp8_peak_tflops > 0:
        raise ConfigError(f"--fp8 on the {hw.name}: it has no FP8 tensor cores "
                          f"(fp8_peak_tflops={hw.fp8_peak_tflops:g}); FP8 GEMMs need an H100 or H200")
    if True in r.fp8 and cfg.dtype != "bfloat16":
        raise ConfigError(f"--fp8 with dtype={cfg.dtype!r}: FP8 GEMMs run in a bfloat16 model; use --dtype bfloat16")
    tm = r.time_model
    for name in ("compute_efficiency", "memory_efficiency", "link_efficiency"):
        if not 0 < getattr(tm, name) <= 1:
            raise ConfigError(f"{name}={getattr(tm, name)!r} must be in (0, 1]")


def validate_expert_sizes(cfg: ModelConfig, sizes: tuple) -> None:
    """E > 1 only for a mixture of experts, each a positive integer that divides its routed experts."""
    for e in sizes:
        if isinstance(e, bool) or not isinstance(e, int) or e <= 0:
            raise ConfigError(f"expert size {e!r} must be a positive integer")
        if e > 1 and not cfg.moe_experts:
            raise ConfigError(f"expert size {e} splits a mixture of experts' experts, and this model has none "
                              "(moe_experts=0): use --expert-sizes 1")
        if cfg.moe_experts and cfg.moe_experts % e:
            raise ConfigError(f"expert size {e} does not divide moe_experts={cfg.moe_experts}; valid: "
                              f"{', '.join(map(str, divisors(cfg.moe_experts)))}")
    if not sizes:
        raise ConfigError("no expert size to try: give --expert-sizes 1 or more")


@dataclass(frozen=True, order=True)
class Candidate:
    tensor: int
    pipe: int
    virtual: int
    data: int
    micro_batch: int
    remat: str
    sequence_parallel: bool
    distributed_optimizer: bool
    microbatches: int  # m = B / (d·f·e·b)
    context: int = 1  # c: G = t·p·d·c·f·e
    context_strategy: str = "all-gather"
    fsdp: int = 1  # f: FSDP ranks, which split the batch's rows as data ranks do and every weight's state
    zero_bubble: bool = False  # ZB-H1 (over v chunks per stage): the backward split into B and W (`parallel.schedule`)
    offload: bool = False  # what its remat policy stores in host memory (`--offload all`: planning/search_offload.py)
    offload_optimizer: bool = False  # the master weights and moments in host memory between steps
    fp8: bool = False  # the layers' weight GEMMs as FP8 GEMMs (models/fp8.py)
    expert: int = 1  # e: a mixture's routed experts split over e ranks, which split the batch's rows as data ranks do

    @property
    def schedule(self) -> str:
        return "zb-h1" if self.zero_bubble else "interleaved" if self.virtual > 1 else "1f1b"

    @property
    def mesh_family(self) -> tuple[int, int]:
        """(t, p): the family of meshes the search reports on (`families`)."""
        return self.tensor, self.pipe

    def label(self) -> str:
        return (f"t={self.tensor} p={self.pipe} v={self.virtual} d={self.data} b={self.micro_batch} "
                f"m={self.microbatches} {self.remat}{'+sp' if self.sequence_parallel else ''}"
                f"{' +distopt' if self.distributed_optimizer else ''}"
                + (f" c={self.context} {self.context_strategy}" if self.context > 1 else "")
                + (f" f={self.fsdp}" if self.fsdp > 1 else "") + (" zb-h1" if self.zero_bubble else "")
                + (" +offload" if self.offload else "") + (" +offload-opt" if self.offload_optimizer else "")
                + (" fp8" if self.fp8 else "") + (f" e={self.expert}" if self.expert > 1 else ""))


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def tensor_sizes(r: Request) -> list[int]:
    """t within a node: the divisors of the GPUs per node (or those the request names)."""
    return sorted(r.tensor_sizes) if r.tensor_sizes else divisors(r.hardware.gpus_per_node)


@dataclass(frozen=True)
class FamilyReason:
    """Why no candidate of a mesh family (t, p) is valid: the rule it breaks, and the sentence that says so.
    rule: "tensor" (t against the heads, the MLP width or the K/V heads: `tensor_reason`), "gpus" (t·p against G),
    "layers" (p against L), "batch" (d = G/(t·p) against the global batch), "microbatches" (m < p for every b); and,
    given by the search itself, "sizes" (no FSDP size and micro-batch asked splits it) and "memory" (none fits)."""

    rule: str
    text: str

    def __str__(self) -> str:
        return self.text


def tensor_reason(cfg: ModelConfig, t: int) -> FamilyReason | None:
    """Why t cannot split the model's layers (whatever p, c and d), or None."""
    if cfg.heads % t or cfg.mlp_hidden % t:
        return FamilyReason("tensor", f"t={t} does not divide heads={cfg.heads}" if cfg.heads % t
                            else f"t={t} does not divide mlp={cfg.mlp_hidden}")
    if cfg.num_kv_heads % t and t % cfg.num_kv_heads:
        return FamilyReason("tensor", f"t={t} neither divides kv_heads={cfg.num_kv_heads} nor is a multiple of it")
    return None


def family_reason(cfg: ModelConfig, r: Request, t: int, p: int) -> FamilyReason | None:
    """Why no candidate of mesh family (t, p) is valid, or None if some are."""
    if reason := tensor_reason(cfg, t):
        return reason
    if r.gpus % (t * p):
        return FamilyReason("gpus", f"t·p={t * p} does not divide {r.gpus} GPUs")
    if cfg.layers % p:
        return FamilyReason("layers", f"p={p} does not divide layers={cfg.layers}")
    d = r.gpus // (t * p)
    if r.global_batch % d:
        return FamilyReason("batch", f"d={d} does not divide the global batch {r.global_batch}")
    if p > 1 and all(r.global_batch % (d * b) or r.global_batch // (d * b) < p for b in r.micro_batches):
        return FamilyReason("microbatches", f"m = B/(d·b) < p={p} for every micro-batch {list(r.micro_batches)}")
    return None


def families(cfg: ModelConfig, r: Request) -> list[tuple[int, int]]:
    """Every (t, p) with t dividing a node and p dividing G/t: the grid the search reports on."""
    return [(t, p) for t in tensor_sizes(r) if r.gpus % t == 0 for p in divisors(r.gpus // t)]


def enumerate_candidates(cfg: ModelConfig, r: Request) -> list[Candidate]:
    """Every valid configuration (see the module docstring), each with its GEMMs in every precision asked (`fp8`)."""
    out = []
    for t, p in families(cfg, r):
        if family_reason(cfg, r, t, p):
            continue
        sps = (False, True) if t > 1 and cfg.seq_len % t == 0 else (False,)
        out += mesh_candidates(cfg, r, t, 1, p, r.gpus // (t * p), sps)
    out += context_candidates(cfg, r)
    return [replace(c, fp8=fp8) for fp8 in r.fp8 for c in out] if r.fp8 != (False,) else out


def context_candidates(cfg: ModelConfig, r: Request) -> list[Candidate]:
    """Every valid configuration with c > 1: G = t·c·p·d, s divisible by 2c (2c·t with SP), each strategy asked,
    under a pipeline too. With fused attention the ring is explicit attention's layer (it computes its blocks itself:
    `costs.run_kernels`)."""
    out = []
    for c in sorted(set(r.context_sizes) - {1}):
        for t in tensor_sizes(r):
            if r.gpus % (t * c) or tensor_reason(cfg, t):  # its data size is G/(t·c·p), checked per mesh below
                continue
            sps = [sp for sp in ((False, True) if t > 1 else (False,)) if cfg.seq_len % (2 * c * (t if sp else 1)) == 0]
            for p in divisors(r.gpus // (t * c)):
                if cfg.layers % p:
                    continue
                d = r.gpus // (t * c * p)
                out += mesh_candidates(cfg, r, t, c, p, d, sps)
    return out


def mesh_candidates(cfg: ModelConfig, r: Request, t: int, c: int, p: int, ranks: int, sps) -> list[Candidate]:
    """The candidates of one t × c × p mesh with `ranks` data-parallel ranks: each split d × f × e with f from the
    request's FSDP sizes (f dividing the hidden size) and e from its expert sizes (a mixture's: e dividing its
    experts, `validate_expert_sizes`), every micro-batch, virtual stage count, strategy (c > 1), policy, SP and
    optimizer the rules allow (m ≥ p under a pipeline, m % p = 0 interleaved; the distributed optimizer over
    d·c > 1)."""
    out = []
    for f in sorted(set(r.fsdp_sizes)):
        for e in sorted(set(r.expert_sizes)):
            if ranks % (f * e) == 0 and cfg.hidden % f == 0:
                out += _mesh_candidates(cfg, r, t, c, p, ranks // (f * e), f, sps, e)
    return out


def _mesh_candidates(cfg: ModelConfig, r: Request, t: int, c: int, p: int, d: int, f: int, sps,
                     e: int = 1) -> list[Candidate]:
    out = []
    vs = [v for v in divisors(cfg.layers // p) if p > 1 or v == 1]
    # ZB-H1 where the executor runs it (a pipeline, no FSDP, no K/V head repeated over tensor ranks:
    # `config.validate_zero_bubble`), with every v and context size
    zero_bubble = "zb-h1" in r.schedules and p > 1 and f == 1 and t <= cfg.num_kv_heads and not cfg.moe_experts
    strategies = r.context_strategies if c > 1 else ("all-gather",)
    for b in r.micro_batches:
        if r.global_batch % (d * f * e * b):
            continue
        m = r.global_batch // (d * f * e * b)
        if p > 1 and m < p:
            continue
        for v in vs:
            if v > 1 and m % p:
                continue
            for strategy in strategies:
                for remat in r.remats:
                    for sp in sps:
                        for dist in ((False, True) if d * c > 1 else (False,)):
                            out.append(Candidate(t, p, v, d, b, remat, sp, dist, m, c, strategy, f, expert=e))
                            if zero_bubble:
                                out.append(Candidate(t, p, v, d, b, remat, sp, dist, m, c, strategy, f, True))
    return out
