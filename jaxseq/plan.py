"""`python -m jaxseq.plan`: memory, FLOPs and collectives per configuration, before renting GPUs
(`--search`: the auto-configurator for a cluster).

The command line only: the plan is `jaxseq.planning` (what each figure is and where it comes from).
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import jax

from jaxseq import cli
from jaxseq.config import ConfigError, ModelConfig, ParallelConfig, on_platform, replace, validate
from jaxseq.presets import preset
from jaxseq.hardware import HARDWARE
from jaxseq.planning import autotune, cost, document_mask, gpu_target, search, search_report, search_space
from jaxseq.planning import moe as moe_plan
from jaxseq.planning.memory import GIB
from jaxseq.planning.plan import plan
from jaxseq.planning.recommend import compiled_block_bytes, recommend
from jaxseq.planning.progress import Progress
from jaxseq.planning.report import format_recommendation, format_table
from jaxseq.planning.search_costs import SearchCosts
from jaxseq.remat import block_spec

# Printed by --help; README's "Where each figure comes from" table says the same.
SOURCES = (
    "Where each figure comes from. From XLA's compiled program (per layer per device): stored (the stacked "
    "buffers the forward layer loop writes, / L), TFLOP and recompute (XLA:CPU's cost_analysis(), with --target "
    "too), collectives (the "
    "collectives of one forward and one backward layer-loop iteration). From the paper's formulas: the "
    "formula column (and so ratio = stored / formula) and the paper's model/hardware FLOPs line (for a Llama "
    "preset, jaxseq's own: formulas.activation_bytes and train_flops, term by term). From shapes "
    "and shardings, nothing compiled: parameters, gradients, Adam moments, the weight copy and the "
    "embedding/logits part of the activations; activ. = stored (compiled) × L + that part; total = "
    "state + activ.")
MAX_SIMULATED_DEVICES = 1024  # pipeline × tensor: 512 (megatron-1t, p=64, t=8) compiles in ~30 s
VERIFIED_WITH_TARGET = 3  # `--search --target`: the best configurations whose whole step is compiled for the GPU


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m jaxseq.plan", description=__doc__.splitlines()[0], epilog=SOURCES)
    _plan_arguments(p)
    _search_arguments(p)
    return p


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    """The model, the layout and the compile: what one plan is of."""
    p.add_argument("--preset", default="gpt3-175b", help="model preset (default gpt3-175b)")
    p.add_argument("--tensor", type=int, default=8, help="tensor-parallel size t (default 8)")
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch b (default 1)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length s (default: the preset's)")
    p.add_argument("--attention", default="explicit", help="explicit (the paper's) or fused")
    p.add_argument("--dtype", default="bfloat16", help="activation dtype: bfloat16 (default) or float32")
    p.add_argument("--dropout", type=float, default=None,
                   help="dropout probability (default: the preset's; the H100's measured runs used 0)")
    p.add_argument("--layer-loop", default="scan",
                   help="the run's layer loop: scan (default) or unrolled: the whole steps --target compiles, and "
                        "the search's time (no scan stacks); layers are measured scanned. A GPU run without a "
                        "pipeline unrolls unless told otherwise (train's default): pass unrolled to plan that run")
    p.add_argument("--pipeline", type=int, default=1,
                   help="pipeline stages p for the whole-model figures (first stage: L/p layers' state, its "
                        "in-flight activations read from the pipelined step compiled on p × t simulated devices); "
                        "default 1")
    p.add_argument("--data", type=int, default=1,
                   help="data-parallel size d: splits the master weights and moments with --distributed-optimizer")
    p.add_argument("--fsdp", type=int, default=1,
                   help="FSDP size F: every weight's master, moments and gradient split over F (each layer gathers "
                        "its weights: the rows' working memory holds them); with --data, HSDP (default 1)")
    p.add_argument("--expert", type=int, default=1,
                   help="expert-parallel size E of a mixture of experts: its parameters (total, active), state per "
                        "device with the routed experts over E and all-to-all per layer, after the table "
                        "(planning/moe.py; links of --hardware, default a100); default 1")
    p.add_argument("--distributed-optimizer", action="store_true",
                   help="totals and --budget-gib assume fp32 master weights and Adam moments split over data "
                        "(the state table shows both)")
    p.add_argument("--schedule", default="1f1b",
                   help="pipeline schedule: gpipe, 1f1b, interleaved, zb-h1 (default 1f1b)")
    p.add_argument("--virtual-stages", type=int, default=1,
                   help="chunks per stage v (interleaved, or zb-h1 over v chunks); default 1")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per step m (default p)")
    p.add_argument("--context", type=int, default=1,
                   help="context-parallel size c: every row compiled on c × t simulated devices (default 1)")
    p.add_argument("--context-strategy", default="all-gather", help="all-gather (default) or ring")
    p.add_argument("--target", default=None,
                   help=f"compile for this GPU ({', '.join(gpu_target.TARGETS)}) on this machine, no GPU needed "
                        "(requirements-gpu-target.txt): each row's layer and whole train step (the plan's stored "
                        "bytes and totals), or each layer of --search; default: XLA:CPU on simulated devices")
    p.add_argument("--autotune-results", default=None, metavar="FILE",
                   help="with --target: the GEMM choices a GPU run recorded (jaxseq.train --record-autotune FILE, "
                        "planned with the JAX that recorded it): each row's whole train step compiles with them where "
                        "the file holds a choice for each of its GEMMs, instead of the larger of the all-Triton and "
                        "all-cuBLAS programs")
    p.add_argument("--offload", default=None,
                   help="each row keeps the stored tensors these checkpoint names tag (comma-separated), or all its "
                        "policy stores, in host memory (train --offload): its device bytes, host bytes, PCIe bytes "
                        "and seconds per step (at --hardware's PCIe bandwidth, default the --target GPU's, else a100); "
                        "with --search, --offload all adds offloading as a choice where a configuration does not fit "
                        "(+offload in its label), ranked with its PCIe time")
    p.add_argument("--offload-optimizer", action="store_true",
                   help="each row with its float32 master weights and Adam moments in host memory between steps "
                        "(train --offload-optimizer); with --search, as a choice (+offload-opt), with --offload all "
                        "too")
    p.add_argument("--fp8", action="store_true",
                   help="the layers' weight GEMMs as FP8 GEMMs (models/fp8.py), with --target: each row's programs "
                        "compiled so, with their FP8 GEMMs counted and the memory FP8 adds; with --search: FP8 as a "
                        "dimension, every configuration searched with and without it")
    p.add_argument("--budget-gib", type=float, default=None,
                   help="recommend the least recompute that fits: by what each policy replays (none, a part of the "
                        "forward, full), then by the measured FLOPs")
    p.add_argument("--document-mask", action="store_true",
                   help="packed documents that do not attend to each other (train --document-mask): every program "
                        "compiled with the mask; the plan notes its segment ids, masks and the ring blocks it can skip")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")


def _search_arguments(p: argparse.ArgumentParser) -> None:
    """--search: the cluster, what to try, the time model's efficiencies, the cost."""
    g = p.add_argument_group("--search", "choose t, p, v, c, d, f, micro-batch, remat, SP and the distributed "
                             "optimizer for a cluster (jaxseq/planning/search_memory.py and search_time.py state the "
                             "memory and time models)")
    g.add_argument("--search", action="store_true", help="rank every valid configuration by predicted step time")
    g.add_argument("--gpus", type=int, help="GPUs in the job (a multiple of --gpus-per-node)")
    g.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    g.add_argument("--hardware", default=None,
                   help=f"node defaults: {', '.join(HARDWARE)} (default: the --target GPU, else a100)")
    g.add_argument("--gpu-memory-gib", type=float, help="memory budget per GPU (default: the hardware's, 80)")
    g.add_argument("--peak-tflops", type=float, help="dense bf16 peak per GPU (default: a100 312, h100 989)")
    g.add_argument("--hbm-gb-per-s", type=float, help="GPU memory bandwidth, GB/s (default: a100 2039, h100 3350)")
    g.add_argument("--sm-count", type=int, help="streaming multiprocessors per GPU (default: a100 108, h100 132)")
    g.add_argument("--gpus-per-node", type=int, help="GPUs per node; t stays within one (default 8)")
    g.add_argument("--intra-node-gb-per-s", type=float, help="NVLink GB/s per direction per GPU (a100 300, h100 450)")
    g.add_argument("--inter-node-gbit-per-s", type=float, help="InfiniBand Gb/s per GPU (a100 200, h100 400)")
    g.add_argument("--micro-batch-sizes", default="1,2,4,8", help="micro-batch sizes b to try (default 1,2,4,8)")
    g.add_argument("--remat-policies", default="none,selective,full", help="remat policies to try")
    g.add_argument("--block-recompute", action="store_true",
                   help="also Megatron's block recompute (remat full:N+POLICY): where a configuration does not fit "
                        "under a policy and fits under full, the fewest full layers per chunk that make it fit")

    g.add_argument("--tensor-sizes", default=None, help="t values to try (default: every divisor of --gpus-per-node)")
    g.add_argument("--context-sizes", default="1,2,4,8",
                   help="context-parallel sizes c to try, where s divides by 2c (2c·t with SP), each with every "
                        "strategy of --context-strategies (default 1,2,4,8)")
    g.add_argument("--context-strategies", default="all-gather,ring",
                   help="context-parallel strategies to try at c > 1: all-gather, ring (default both)")
    g.add_argument("--fsdp-sizes", default="1",
                   help="FSDP sizes f to try: each mesh's data-parallel ranks split d × f, every weight's state over f "
                        "(default 1: no FSDP; e.g. 1,2,4,8)")
    g.add_argument("--expert-sizes", default=None,
                   help="a mixture of experts' expert-parallel sizes e to try, each dividing its routed experts: the "
                        "data ranks split d × f × e (default: every divisor of the experts; 1 for a dense model)")
    g.add_argument("--schedules", default="1f1b",
                   help="pipeline schedules to try: 1f1b (with interleaved, v > 1) and zb-h1 (zero bubble: the "
                        "backward split into B and W); default 1f1b")
    g.add_argument("--lockstep", action="store_true",
                   help="price pipeline ticks as jaxseq's executor runs them, each waiting for its slowest stage's op "
                        "(1F1B's whole backward, or ZB-H1's F, B or W); default: asynchronous stages, as Megatron-LM "
                        "and the calibration")
    g.add_argument("--fsdp-overlap", action="store_true",
                   help="charge FSDP's gathers and reduce-scatters only beyond the compute of the micro-batch they can "
                        "hide behind (MaxText's pipelined gathers; default: not overlapped, as nothing is)")
    g.add_argument("--verify", type=int, default=None,
                   help="with --target: compile the best N configurations' whole train steps for the GPU and hold "
                        "them to the budget by that program's peak, not the parts added up (a step over it leaves "
                        f"the ranking, the next verified in its place; default {VERIFIED_WITH_TARGET} with --target, "
                        "0 without)")
    g.add_argument("--scale-context", action="store_true",
                   help="at c > 1 scale the compiled c = 1 layer (costs.at_context: stored / c, working / c + the K/V "
                        "transient) instead of compiling it on c × t simulated devices: fewer compiles, the working "
                        "memory a stated estimate (the table's layer column says which rows are which)")
    g.add_argument("--compute-efficiency", type=float, default=search_space.COMPUTE_EFFICIENCY,
                   help=f"achieved fraction of peak of a GEMM's full wave of tiles (default "
                        f"{search_space.COMPUTE_EFFICIENCY}, calibrated on Korthikanti et al. Table 5, 175B)")
    g.add_argument("--memory-efficiency", type=float, default=search_space.MEMORY_EFFICIENCY,
                   help=f"achieved fraction of memory bandwidth by elementwise kernels (default "
                        f"{search_space.MEMORY_EFFICIENCY})")
    g.add_argument("--link-efficiency", type=float, default=search_space.LINK_EFFICIENCY,
                   help=f"achieved fraction of link bandwidth (default {search_space.LINK_EFFICIENCY})")
    g.add_argument("--top", type=int, default=10, help="configurations to list (default 10)")
    g.add_argument("--tokens", type=float, default=None,
                   help="the run's total tokens (e.g. 1e12): each row's days, GPU-hours and, with "
                        "--price-per-gpu-hour, dollars to train them at its step time, each with the time model's "
                        "measured error band (planning/cost.py)")
    g.add_argument("--price-per-gpu-hour", type=float, default=None,
                   help="dollars one GPU costs an hour (with --tokens)")

def resolve(args) -> ModelConfig:
    cfg = replace(preset(args.preset), attention=args.attention, dtype=args.dtype, layer_loop=args.layer_loop)
    if args.seq_len is not None:
        cfg = replace(cfg, seq_len=args.seq_len)
    if args.dropout is not None:
        cfg = replace(cfg, dropout=args.dropout)
    if args.document_mask:  # any id ends a document in a program compiled on abstract tokens: the vocabulary's last
        cfg = replace(cfg, document_mask=True, eod_token=cfg.vocab_size - 1)
    if args.fp8 and not args.search:
        fp8_targets = [t for t in gpu_target.TARGETS if HARDWARE[t].fp8_peak_tflops > 0]  # FP8 tensor cores
        if args.target not in fp8_targets:
            where = "without --target" if args.target is None else f"with --target {args.target}"
            raise ConfigError(f"--fp8 {where}: FP8 GEMMs are the program of a GPU with FP8 tensor "
                              f"cores (on the CPU they are emulated in bf16): plan them with --target "
                              f"({', '.join(fp8_targets)})")
        cfg = replace(cfg, fp8=True)
    if args.data <= 0:
        raise ConfigError(f"data={args.data} must be a positive integer")
    if args.budget_gib is not None and not args.budget_gib > 0:
        raise ConfigError(f"budget_gib={args.budget_gib:g} must be positive")
    return cfg


def host_devices(n: int):
    """n simulated CPU devices: asked for before JAX's backend starts (the command line); called where the backend
    already runs (the command in-process, as the tests run it), the CPU devices it has, if there are enough."""
    try:
        jax.config.update("jax_num_cpu_devices", max(n, 1))
    except RuntimeError:  # the backend has started: its device count is fixed
        if len(jax.devices("cpu")) < n:
            raise ConfigError(f"{n} simulated CPU devices are needed; this process already started JAX with "
                              f"{len(jax.devices('cpu'))}") from None
    return jax.devices("cpu")[: max(n, 1)]


def search_devices(r: search_space.Request, scale_context: bool = False):
    """The simulated devices `--search` compiles on: enough for every t·c it tries (at most
    MAX_SIMULATED_DEVICES; with `scale_context` only the largest t); in-process, where the backend already runs
    with fewer, the ones it has (at least the largest t): a c > 1 layer beyond them is scaled from c = 1
    (`costs.at_context`)."""
    tensor = max(search_space.tensor_sizes(r))
    if scale_context:
        return host_devices(tensor)
    wanted = min(max(t * c for t in search_space.tensor_sizes(r) for c in r.context_sizes), MAX_SIMULATED_DEVICES)
    try:
        return host_devices(max(wanted, tensor))
    except ConfigError:
        host_devices(tensor)  # one line where not even the largest t fits
        return jax.devices("cpu")


def pricing(args) -> cost.Pricing | None:
    """--tokens and --price-per-gpu-hour (one-line ConfigErrors), or None."""
    if args.tokens is None and args.price_per_gpu_hour is None:
        return None
    if not args.search:
        raise ConfigError("--tokens and --price-per-gpu-hour price the rows of --search, which predicts each step's "
                          "time (the plan's rows do not): add --search with --gpus and --global-batch")
    if args.tokens is None:
        raise ConfigError("--price-per-gpu-hour needs --tokens, the run's total tokens (e.g. --tokens 1e12)")
    if not (args.tokens >= 1 and args.tokens == int(args.tokens)):
        raise ConfigError(f"tokens={args.tokens:g} must be a whole number of tokens, at least 1")
    if args.price_per_gpu_hour is not None and not args.price_per_gpu_hour > 0:
        raise ConfigError(f"price_per_gpu_hour={args.price_per_gpu_hour:g} must be positive (dollars per GPU-hour)")
    return cost.Pricing(int(args.tokens), args.price_per_gpu_hour)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.target is not None:
        gpu_target.cpu_only()  # before JAX's backends start: the CUDA plugin compiles for the target without a GPU
    return cli.run(lambda: _search(args) if args.search else _plan(args))


def search_request(args) -> search_space.Request:
    """The cluster and the search space from the command line (one-line ConfigErrors)."""
    if args.gpus is None or args.global_batch is None:
        raise ConfigError("--search needs --gpus and --global-batch")
    if args.target is not None:
        gpu_target.target_config(args.target)  # a known GPU, or one line
    name = args.hardware or args.target or "a100"
    if name not in HARDWARE:
        raise ConfigError(f"hardware={name!r} is not known; valid: {', '.join(HARDWARE)}")
    if args.target is not None and name != args.target:
        raise ConfigError(f"--hardware {name} with --target {args.target}: the layers compiled for the {args.target} "
                          f"would be timed as the {name}'s; leave --hardware out (it follows --target) or make "
                          "them agree")
    overrides = {"memory_gib": args.gpu_memory_gib, "peak_tflops": args.peak_tflops, "hbm_gb_per_s": args.hbm_gb_per_s,
                 "sm_count": args.sm_count, "gpus_per_node": args.gpus_per_node,
                 "intra_node_gb_per_s": args.intra_node_gb_per_s, "inter_node_gbit_per_s": args.inter_node_gbit_per_s}
    hardware = replace(HARDWARE[name], **{k: v for k, v in overrides.items() if v is not None})
    time_model = search_space.TimeModel(compute_efficiency=args.compute_efficiency,
                             memory_efficiency=args.memory_efficiency,
                             link_efficiency=args.link_efficiency, fsdp_overlap=args.fsdp_overlap,
                             lockstep=args.lockstep, scan_stacks=args.layer_loop == "scan")
    return search_space.Request(args.gpus, args.global_batch, hardware, search.parse_list(args.micro_batch_sizes),
                     search.parse_list(args.remat_policies, str), time_model,
                     search.parse_list(args.tensor_sizes) if args.tensor_sizes else None,
                     search.parse_list(args.context_sizes),
                     search.parse_list(args.fsdp_sizes), search.parse_list(args.schedules, str),
                     search.parse_list(args.context_strategies, str), args.block_recompute, search_offload(args),
                     args.offload_optimizer, (False, True) if args.fp8 else (False,))


def expert_sizes(args, cfg: ModelConfig) -> tuple[int, ...]:
    """--expert-sizes, or by default every divisor of a mixture's routed experts (1 for a dense model); --expert is
    the plan's one size, refused with --search in one line."""
    if args.expert != 1:
        raise ConfigError(f"--expert {args.expert} is the plan's expert size; --search tries a list: "
                          f"--expert-sizes {args.expert}")
    if args.expert_sizes is not None:
        return search.parse_list(args.expert_sizes)
    return tuple(search_space.divisors(cfg.moe_experts)) if cfg.moe_experts else (1,)


def search_offload(args) -> bool:
    """--search --offload all: host offload as a choice (everything each candidate's policy stores); one line for a
    list of names, which the search does not try."""
    if args.offload is None:
        return False
    if args.offload.strip() != "all":
        raise ConfigError(f"--search --offload {args.offload}: the search tries offloading everything a candidate's "
                          "policy stores (--offload all); a list of names is for the plan's rows (without --search)")
    return True


def _search(args) -> int:
    recorded_gemms(args)  # refused with --search, in one line
    priced = pricing(args)
    cfg = resolve(args)
    validate(cfg, ParallelConfig(), "none")
    request = replace(search_request(args), expert_sizes=expert_sizes(args, cfg))
    search_space.validate_request(cfg, request)
    if not isinstance(args.top, int) or args.top <= 0:
        raise ConfigError(f"top={args.top} must be a positive integer")
    verify = (VERIFIED_WITH_TARGET if args.target is not None else 0) if args.verify is None else args.verify
    if not isinstance(verify, int) or verify < 0:
        raise ConfigError(f"verify={verify} must be a non-negative integer")
    if verify and args.target is None:
        raise ConfigError(f"--verify {verify} compiles whole train steps for a GPU: it needs --target "
                          f"({', '.join(gpu_target.TARGETS)})")
    devices = search_devices(request, args.scale_context)
    where = "simulated CPU devices"
    if args.target is not None:  # as many target GPUs as the simulated devices: the same layers compile
        cfg, devices, where = on_platform(cfg, "gpu"), gpu_target.target_devices(args.target, len(devices)), args.target
    progress = Progress("search")  # on stderr: stdout holds the table or the JSON alone
    progress.note(f"{args.preset}: compiling each layer's programs on up to {len(devices)} {where} "
                  f"(c·t beyond them scaled from c = 1), two at a time")
    costs = SearchCosts(cfg, devices, progress=progress)
    result = search.search(cfg, request, costs, args.preset, target=args.target)
    if verify:
        progress.phase(f"the best {verify} configurations' whole train steps for the {args.target} (and the next in "
                       "place of any over the budget)", None)
        result = search.verify(result, verify, partial(target_step_costs, cfg, args.target, progress), costs)
    print(json.dumps(search_report.to_json(result, args.top, priced), indent=1) if args.json
          else search_report.format_result(result, args.top, priced))
    return 0


def candidate_parallel(c: search_space.Candidate) -> ParallelConfig:
    """The mesh search candidate `c`'s whole train step compiles on (`gpu_target.step_parallel`)."""
    return gpu_target.step_parallel(tensor=c.tensor, sequence_parallel=c.sequence_parallel, data=c.data,
                                    distributed_optimizer=c.distributed_optimizer, pipeline=c.pipe,
                                    schedule=c.schedule, virtual_stages=c.virtual, context=c.context,
                                    strategy=c.context_strategy, fsdp=c.fsdp)


def target_step_costs(cfg: ModelConfig, target: str, progress, c: search_space.Candidate) -> tuple[int, int | None]:
    """Candidate `c`'s whole train step compiled for `target` (at the model's depth, on its full mesh as
    `gpu_target.step_parallel` sizes it): its peak bytes per device and, where its time is priced on them (no
    pipeline: `search_time.program_step_time`), its memory-bound kernels' bytes, else None (its HLO not read)."""
    parallel, cfg = candidate_parallel(c), replace(cfg, fp8=c.fp8)
    progress.compiling(f"{c.label()}: the whole train step on {parallel.num_devices} {target}(s)")
    if c.pipe > 1:
        return gpu_target.step_bytes(cfg, parallel, c.remat, c.micro_batch, c.microbatches, target), None
    return gpu_target.step_costs(cfg, parallel, c.remat, c.micro_batch, c.microbatches, target)


def recorded_gemms(args) -> autotune.RecordedGemms | None:
    """--autotune-results, read (one line if it cannot be), or None."""
    if args.autotune_results is None:
        return None
    if args.target is None:
        raise ConfigError(f"--autotune-results {args.autotune_results}: GEMM choices for a GPU's program; it needs "
                          f"--target ({', '.join(gpu_target.TARGETS)})")
    if args.search:
        raise ConfigError("--autotune-results: a recorded file holds one step's GEMM choices; --search compiles "
                          "other programs (its layers at micro-batches 1 and 2): plan that step without --search")
    return autotune.RecordedGemms(args.autotune_results)


def _plan(args) -> int:
    pricing(args)  # refused without --search, in one line
    cfg = resolve(args)
    context = ParallelConfig(data=1, context=args.context, tensor=args.tensor, context_strategy=args.context_strategy)
    validate(cfg, context, "none")
    if args.expert != 1:  # the experts split over E ranks: one line if they cannot be
        validate(cfg, replace(context, expert=args.expert), "none")
    moe_lines = moe_report(args, cfg) if cfg.moe_experts else None  # before compiling: bad --hardware in one line
    pipe = args.pipeline if args.pipeline > 1 else 1  # the pipelined step compiles on pipeline × tensor devices
    if args.context > 1 and pipe > 1:
        validate(cfg, replace(context, pipe=pipe), "none")  # the pipelined step at context c: one line if it cannot run
    if args.tensor * pipe * args.context > MAX_SIMULATED_DEVICES:
        raise ConfigError(f"pipeline={args.pipeline} × tensor={args.tensor} = {args.tensor * pipe} simulated devices "
                          f"to compile the pipelined step; at most {MAX_SIMULATED_DEVICES}")
    progress = Progress("plan")  # on stderr: stdout holds the table or the JSON alone
    try:
        p = plan(cfg, args.tensor, args.micro_batch_size, host_devices(args.tensor * pipe * args.context), args.preset,
                 args.pipeline, schedule=args.schedule, virtual_stages=args.virtual_stages,
                 microbatches=args.microbatches, data=args.data, distributed_optimizer=args.distributed_optimizer,
                 context=args.context, context_strategy=args.context_strategy, progress=progress,
                 target=args.target, fsdp=args.fsdp, recorded=recorded_gemms(args), offload=args.offload,
                 offload_optimizer=args.offload_optimizer, pcie_gb_per_s=plan_hardware(args).pcie_gb_per_s)
    except ValueError as e:  # e.g. JAX refusing a device count: still one line
        raise ConfigError(str(e)) from None
    chosen, rejected = recommend(p, args.budget_gib * GIB) if args.budget_gib is not None else (None, [])
    compiled = block_on_target(args, p, chosen, progress)
    held = p.microbatches if p.pipeline > 1 else 1  # a pipeline's stages hold every micro-batch's segment ids
    documents = (document_mask.costs(cfg, args.micro_batch_size, args.tensor, args.context, args.context_strategy, held)
                 if cfg.document_mask else None)
    if args.json:
        out = p.to_json()
        out["document_mask"] = documents
        if args.budget_gib is not None:
            out["budget"] = {"budget_gib": args.budget_gib, "recommended": chosen and chosen.config,
                             "recommended_remat": chosen and chosen.remat,
                             "recommended_total_bytes_per_device": chosen and chosen.total_bytes_per_device,
                             "recommended_compiled_bytes_per_device": compiled,
                             "rejected": [{"config": r.config, "reason": why} for r, why in rejected]}
        print(json.dumps(out, indent=1))
    else:
        print(format_table(p))
        if documents is not None:
            print(document_mask.format_note(documents))
        if moe_lines is not None:
            print()
            print(moe_lines)
        if args.budget_gib is not None:
            print()
            print(format_recommendation(p, args.budget_gib))
            if compiled is not None:
                print(f"    its whole train step compiled for the {args.target} with --remat {chosen.remat}: "
                      f"{compiled / GIB:.1f} GiB per device "
                      f"({'within' if compiled <= args.budget_gib * GIB else 'over'}"
                      f" the budget; the composed row {chosen.total_bytes_per_device / GIB:.1f} GiB)")
    return 0


def moe_report(args, cfg: ModelConfig) -> str:
    """A mixture of experts' lines (planning/moe.py) on --hardware's links (`plan_hardware`)."""
    return moe_plan.report(cfg, tensor=args.tensor, expert=args.expert, context=args.context,
                           micro_batch=args.micro_batch_size, microbatches=args.microbatches or args.pipeline,
                           hw=plan_hardware(args))


def plan_hardware(args):
    """The node a plan's PCIe figures are for: --hardware, else the --target GPU, else an A100 (as --search's)."""
    name = args.hardware or args.target or "a100"
    if name not in HARDWARE:
        raise ConfigError(f"hardware={name!r} is not known; valid: {', '.join(HARDWARE)}")
    return HARDWARE[name]


def block_on_target(args, p, chosen, progress: Progress) -> int | None:
    """With --target, a recommended block recompute compiled as it would run (`compiled_block_bytes`, a phase of its
    own: known once the plan's rows are); else None."""
    if args.target is None or chosen is None or block_spec(chosen.remat) is None:
        return None
    progress.phase(f"the recommended {chosen.remat}, compiled as it would run", 1)
    return compiled_block_bytes(p, chosen, args.target, progress)


if __name__ == "__main__":
    sys.exit(main())
