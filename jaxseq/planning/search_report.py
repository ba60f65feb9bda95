"""`plan --search`'s output: the ranking as a table with its notes (`format_result`), and as JSON (`to_json`),
as `planning.report` prints `planning.plan`'s rows. Every figure is labelled with its unit; the notes say which
model or program each column comes from.
"""

from __future__ import annotations

from dataclasses import asdict

from jaxseq.models import formulas
from jaxseq.models import model
from jaxseq.planning import cost, host_tier, kernel_time
from jaxseq.planning.costs import ring_size, run_kernels
from jaxseq.planning.search import Evaluated, Result
from jaxseq.planning.search_memory import MEMORY_ACCOUNTING
from jaxseq.planning.search_space import GIB, Candidate

FSDP_NOTE = ("f = FSDP ranks (d·f ranks split the batch's rows; every weight's state split over f); FSDP s = each "
             "layer's weights gathered in forward and again in backward and their float32 gradients reduce-scattered, "
             "per micro-batch, over the f ranks' links (NVLink where t·c·f fits a node, else one InfiniBand link per "
             "rank of the group in a node), not "
             "overlapped with compute (with --fsdp-overlap: only what the micro-batch's compute cannot hide); its "
             "memory: the state over f plus one layer's gathered weights and gradient (memory.fsdp_gathered_bytes)")


ZERO_BUBBLE_NOTE = ("v = zb: ZB-H1 (the backward split into B and W; v = 2z: over 2 chunks per stage, interleaved; "
                    "searched without FSDP or K/V heads repeated over t): bubble (p − 1)(T_F + T_B − T_W)/"
                    "(v·m(T_F + T_B + T_W)) at the layer's kernel times (Qi et al.; 1F1B's is (p − 1)/m), memory + "
                    "the W stash (p slots of L/(p·v) layers' weight-matmul inputs and output gradients: "
                    "formulas.deferred_stash_bytes; stage 0's activations L layers, 1F1B's), TP + the two "
                    "[b, s, h] all-gathers per layer W adds under SP; both "
                    "schedules priced as Megatron's asynchronous stages run them, where jaxseq's lock-step executor "
                    "gains more from ZB-H1 (docs/parallelism.md)")


BLOCK_NOTE = ("full:N+POLICY: Megatron-LM's block recompute (--recompute-method block --recompute-num-layers N where "
              "POLICY is none), added where a configuration does not fit under POLICY and fits under full: the first "
              "N layers of each chunk (L/(p·v)) under full, the fewest that fit; its memory the larger of the two "
              "backward loops' peaks (search_memory.block_memory), its time N/(L/(p·v)) of the way from POLICY's to "
              "full's")


def format_result(res: Result, top: int = 10, pricing: cost.Pricing | None = None) -> str:
    """The ranking's first `top` as a table: a header of the model, the cluster and the models' constants, a row
    per configuration, and the notes of the columns and options shown; with `pricing`, each row's days, GPU-hours
    and dollars to train its tokens (`planning.cost`)."""
    fsdp = any(f > 1 for f in res.request.fsdp_sizes)  # the f and FSDP s columns, where FSDP is searched
    verified = any(e.compiled_bytes is not None for e in res.ranked[:top])  # the step GiB column (`verify`)
    remat_width = max([10, *(len(_remat_cell(e.candidate)) + 1 for e in res.ranked[:top])])  # block specs, offload
    priced = pricing is not None
    fp8 = True in res.request.fp8  # the GEMM column, where FP8 is searched
    moe = bool(res.config.moe_experts)  # the e and EP s columns, for a mixture of experts
    heads = _column_heads(fsdp, verified, remat_width, f"{'days':>9}{'GPU-h':>11}{'cost $':>13}" if priced else "", fp8,
                          moe)
    rows = [_row(i, e, fsdp, verified, remat_width, _cost_cells(row_cost(res, e, pricing)) if priced else "", fp8,
                 moe) for i, e in enumerate(res.ranked[:top])]
    notes = _notes(res, fsdp, verified)
    if pricing is not None:
        notes.insert(1, cost.format_note(pricing, res.request.global_batch, res.config.seq_len, _band(res)))
    return "\n".join([*_header(res), "", heads, *rows, *notes])


def _band(res: Result) -> cost.Band:
    return cost.band(res.request.gpus, res.target)


def row_cost(res: Result, e: Evaluated, pricing: cost.Pricing) -> dict:
    """Row e's days, GPU-hours and dollars to train `pricing.tokens` at its predicted step time
    (`cost.training_cost`)."""
    return cost.training_cost(e.time.total_s, pricing, res.request.global_batch, res.config.seq_len, res.request.gpus,
                              _band(res))


def _cost_cells(c: dict) -> str:
    """A row's days, GPU-h and cost $ cells (`row_cost`; "-" without a price)."""
    dollars = "-" if c["cost"] is None else f"{c['cost']['value']:,.0f}"
    return f"{c['days']['value']:>9.2f}{c['gpu_hours']['value']:>11,.0f}{dollars:>13}"


def _header(res: Result) -> list[str]:
    """The model and cluster, the time and memory models, and how many configurations were evaluated."""
    cfg, r, hw, tm = res.config, res.request, res.request.hardware, res.request.time_model
    return [
        f"{res.model}: h={cfg.hidden} a={cfg.heads}{model.shape_label(cfg)} L={cfg.layers} s={cfg.seq_len} "
        f"V={cfg.vocab_size} {cfg.dtype}; "
        f"{r.gpus} GPUs ({hw.name}: {hw.gpus_per_node} per node, {hw.memory_gib:g} GiB, "
        f"peak {hw.peak_tflops:g} TFLOP/s, "
        f"HBM {hw.hbm_gb_per_s:g} GB/s, {hw.sm_count} SMs, NVLink {hw.intra_node_gb_per_s:g} GB/s, "
        f"IB {hw.inter_node_gbit_per_s:g} Gb/s per GPU); global batch {r.global_batch}",
        f"time model: each GEMM in waves of {kernel_time.TILE[0]}×{kernel_time.TILE[1]} tiles at "
        f"{tm.compute_efficiency:g} of peak or at HBM speed if memory-bound, "
        + (f"fused attention at cuDNN's {kernel_time.FLASH_FORWARD_EFFICIENCY:.2f} (forward) and "
           f"{kernel_time.FLASH_BACKWARD_EFFICIENCY:.2f} "
           "(backward) of peak (XLA's kernel in float32 and the all-gather context strategy: its GEMMs and softmax, "
           "QKᵀ replayed), " if cfg.attention == "fused" else "")
        + ("the ring's attention as its blocks (2c + 1 of (s/2c)² a rank, 7 GEMMs each, the backward recomputing "
           "every block), " if any(ring_size(e.candidate) > 1 for e in res.ranked) else "")
        + f"{memory_bound_source(res)} at {tm.memory_efficiency:g} of HBM bandwidth, "
        f"links at {tm.link_efficiency:g} of bandwidth, "
        + ("nothing overlapped but FSDP's gathers and reduce-scatters (hidden behind each micro-batch's compute "
           "where they fit: --fsdp-overlap)" if tm.fsdp_overlap else "nothing overlapped")
        + ("; pipeline ticks lock-step (each waits for its slowest stage's F, B or W: --lockstep)" if tm.lockstep
           else "; pipeline stages asynchronous (Megatron's; jaxseq's executor runs lock-step: --lockstep)"),
        f"memory: {MEMORY_ACCOUNTING}; {memory_source(res)}",
        f"{res.evaluated} configurations evaluated, {len(res.ranked)} fit; {res.compiled} layers (t, SP, remat; c and "
        f"strategy where compiled at c > 1; the ring's on explicit attention) measured from compiled programs",
    ]


def _column_heads(fsdp: bool, verified: bool, remat_width: int, priced: str = "", fp8: bool = False,
                  moe: bool = False) -> str:
    f_head, fsdp_head = (f" {'f':>2}", f"{'FSDP s':>8}") if fsdp else ("", "")
    f_head, fsdp_head = f_head + (f" {'e':>3}" if moe else ""), fsdp_head + (f"{'EP s':>8}" if moe else "")
    step_head = f"{'step GiB':>9}{'GPU s':>9}" if verified else ""
    return (f"{'#':>3} {'t':>2} {'p':>3} {'v':>2} {'c':>2} {'d':>4}{f_head} {'b':>2} {'m':>5} "
            f"{'remat':<{remat_width}}{'SP':<4}{'DO':<4}{('GEMM' if fp8 else ''):<{5 if fp8 else 0}}"
            f"{'mem GiB':>8}{step_head}{'step s':>9}{'TFLOP/s':>9}{'MFU':>7}{'bubble':>8}{'comp s':>9}{'TP s':>8}"
            f"{'p2p s':>8}{'DP s':>8}{'CP s':>8}{fsdp_head}{'opt s':>8}{priced}  CP strategy, layer")


def _remat_cell(c: Candidate) -> str:
    """The remat column: the policy or block spec, +off where what it stores is offloaded, +opt the optimizer state."""
    return c.remat + ("+off" if c.offload else "") + ("+opt" if c.offload_optimizer else "")


def _v_cell(c: Candidate) -> str:
    """The v column: chunks per stage; zb: ZB-H1, 2z: ZB-H1 over 2 chunks per stage."""
    return (f"{c.virtual}z" if c.virtual > 1 else "zb") if c.zero_bubble else str(c.virtual)


def _row(i: int, e: Evaluated, fsdp: bool, verified: bool, remat_width: int, priced: str = "",
         fp8: bool = False, moe: bool = False) -> str:
    """The table's row of the i-th (from 0) configuration: memory in GiB per device, times in seconds per step;
    `priced`: its cost cells (`_cost_cells`), before the CP strategy; with `fp8` (FP8 searched), its weight GEMMs'
    precision."""
    c, t = e.candidate, e.time
    step_cell = "" if not verified else "-".rjust(9) if e.compiled_bytes is None else f"{e.compiled_bytes / GIB:>9.1f}"
    step_cell += "" if not verified else "-".rjust(9) if e.compiled_step_s is None else f"{e.compiled_step_s:>9.3f}"
    return (f"{i + 1:>3} {c.tensor:>2} {c.pipe:>3} {_v_cell(c):>2} {c.context:>2} {c.data:>4}"
            f"{f' {c.fsdp:>2}' if fsdp else ''}{f' {c.expert:>3}' if moe else ''} "
            f"{c.micro_batch:>2} {c.microbatches:>5} "
            f"{_remat_cell(c):<{remat_width}}{'yes' if c.sequence_parallel else 'no':<4}"
            f"{'yes' if c.distributed_optimizer else 'no':<4}"
            f"{('fp8' if c.fp8 else 'bf16') if fp8 else '':<{5 if fp8 else 0}}"
            f"{e.memory.total_bytes / GIB:>8.1f}{step_cell}{t.total_s:>9.3f}{e.model_tflops_per_gpu:>9.1f}"
            f"{100 * e.mfu:>6.1f}%"
            f"{100 * t.bubble:>7.1f}%{t.compute_s:>9.3f}{t.tp_s:>8.3f}{t.p2p_s:>8.3f}{t.dp_s:>8.3f}{t.context_s:>8.3f}"
            f"{f'{t.fsdp_s:>8.3f}' if fsdp else ''}{f'{t.expert_s:>8.3f}' if moe else ''}{t.optimizer_s:>8.3f}{priced}"
            f"  {f'{c.context_strategy}, {e.layer_source}' if c.context > 1 else '-'}"
            + (f"; host {e.memory.host_bytes / GIB:.1f} GiB, PCIe {t.pcie_s:.3f} s" if c.offload or c.offload_optimizer
               else ""))


def _notes(res: Result, fsdp: bool, verified: bool) -> list[str]:
    """The notes under the table: the columns, then each option's shown (FSDP, ZB-H1, block recompute, the
    compiled step), the fused-attention caveat, and the mesh families with no configuration that fits."""
    r = res.request
    flops = ("72·B·s·L·h²·(1 + s/(6h) + V/(12hL))" if model.traits(res.config).papers_formulas
             else "formulas.train_flops: K/V heads once, the MLP's gate, up and down, the logits")
    lines = ["", f"TFLOP/s: model FLOPs per GPU ({flops}, no recompute) / predicted step time; "
                 "MFU = that / peak; comp/TP/p2p exclude the bubble's share; c = context-parallel size, CP s = its "
                 "K/V traffic, opt s = the optimizer step (HBM traffic) "
                 "(formulas.context_kv_bytes); layer: at c > 1 the layer's stored and working memory and TP "
                 "collectives compiled on a c × t mesh (\"compiled\"), or, where c·t exceeds the simulated devices, "
                 "the compiled c = 1 layer's scaled (\"scaled\": costs.at_context)"]
    if verified:
        lines += [f"step GiB: the whole train step compiled for the {res.target} (its peak per device: argument + "
                  "output + temp − alias), where mem GiB adds the parts up; GPU s: its step time priced on that "
                  "program (its GEMMs and attention as step s prices them, the bytes its other kernels move at HBM "
                  "speed: search_time.program_step_time; - under a pipeline); a configuration whose step does not "
                  "fit left the ranking: " + ("; ".join(f"{e.candidate.label()} ({e.compiled_bytes / GIB:.1f} GiB)"
                                                        for e in res.over_budget) or "none")]
    if fsdp:
        lines += [FSDP_NOTE]
    if "zb-h1" in r.schedules:
        lines += [ZERO_BUBBLE_NOTE]
    if r.block_recompute:
        lines += [BLOCK_NOTE]
    if r.offload or r.offload_optimizer:
        lines += [f"+off: everything the policy stores in host memory (--offload all), +opt: the float32 master "
                  f"weights and Adam moments (--offload-optimizer), tried where a configuration does not fit as it is; "
                  f"mem GiB is the device's, host GiB what it holds in host memory, PCIe s what the step is charged at "
                  f"{r.hardware.pcie_gb_per_s:g} GB/s per direction × {r.time_model.link_efficiency:g} "
                  f"(planning/host_tier.py): {host_tier.OVERLAP}"]
    if True in r.fp8:
        lines += [fp8_note(res)]
    if res.config.moe_experts:
        lines += [moe_note(res)]
    if caveat_applies(res):
        lines += ["", fused_attention_caveat(res)]
    if res.rejected_families:
        lines += ["", "mesh families (t, p) with no configuration that fits:"]
        lines += [f"  t={f['tensor']} p={f['pipe']} d={f['data']}: {f['reason']}" for f in res.rejected_families]
    return lines


def moe_note(res: Result) -> str:
    """How a mixture of experts is searched: the expert size e, its memory and its time."""
    cfg = res.config
    rule = "dropless, C = T" if cfg.moe_capacity_factor is None else f"capacity factor {cfg.moe_capacity_factor}"
    return (f"e = expert-parallel size (E = {cfg.moe_experts} routed experts, top-{cfg.moe_top_k}, {rule}; e of the "
            "d·f·e data ranks, between context and fsdp in the mesh): the routed experts' weights, gradients and "
            "moments split over e (memory.state_bytes(expert=e)), their gradients reduced over d·c, the dense ones "
            "over d·e·c; stored bytes per layer the compiled layer's (e-independent: a rank's group of b·s/c tokens "
            "and its E·C slots; formulas.moe_activation_bytes), working memory compiled at e = 1 (an upper bound: a "
            "layer's experts whole); time: the experts' GEMMs batched over E at C slots each, capacity-padded "
            "(kernel_time.moe_gemms), the router, the dispatch and combine at HBM speed; EP s = the dispatch and "
            "combine all-to-alls of every layer, forward, backward and, where the policy keeps not the dispatched "
            "buffer (full, dots), replayed, [E, C, h] each, NVLink to "
            "expert ranks in the node and InfiniBand past it, the slower link the time (planning/moe.all_to_all), "
            "not overlapped; TFLOP/s counts each token's k experts and the router (formulas.moe_matmul_flops)")


def fp8_note(res: Result) -> str:
    """How an FP8 configuration is priced (`kernel_time.FP8_RELATIVE_EFFICIENCY`) and where its memory comes from."""
    hw, tm = res.request.hardware, res.request.time_model
    fraction = tm.compute_efficiency * kernel_time.FP8_RELATIVE_EFFICIENCY
    moved = (f"the bytes its {res.target} layer program's loops move (the quantization's amax reductions, casts and "
             "transposed copies among them)" if res.target is not None else
             "Megatron's kernels counted + the quantization's (kernel_time.fp8_quantize_bytes)")
    return (f"GEMM fp8: the layers' weight GEMMs (QKV, attention output, MLP in and out; forward and both backward) as "
            f"FP8 GEMMs at {fraction:.3f} of the FP8 peak {hw.fp8_peak_tflops:g} TFLOP/s a full wave (the compute "
            f"efficiency × {kernel_time.FP8_RELATIVE_EFFICIENCY:.3f}, FP8's achievable fraction of its peak over "
            f"bf16's: kernel_time.FP8_RELATIVE_EFFICIENCY), 1-byte operands; the LM head and attention core in bf16; "
            f"memory-bound bytes {moved}; its memory the FP8 model's layers compiled as the bf16 ones; MFU against the "
            f"bf16 peak")


def memory_bound_source(res: Result) -> str:
    """Where the time model's memory-bound bytes come from: the layers' GPU programs (`plan --search --target`) or
    Megatron's kernels, counted (`search_time.compute_seconds`)."""
    stacks = res.request.time_model.scan_stacks
    if res.target is not None:
        return (f"the memory-bound kernels of each layer's {res.target} program (the bytes its loops move: XLA:GPU's "
                f"fusions, {'the stacks zero-filled' if stacks else 'the scan stacks taken out'})")
    return ("Megatron's elementwise kernels (counted)"
            + (" and the scan's stacked activations and weights" if stacks else ""))


def memory_source(res: Result) -> str:
    """Which compiler's programs the layers were measured from: a GPU's (`plan --search --target`) or XLA:CPU's."""
    if res.target is not None:
        return (f"layers compiled for the {res.target} (XLA:GPU, no GPU needed: planning/gpu_target.py); the "
                "parts added up: within 3.7% of the H100's measured peaks, scanned layers on XLA's Triton GEMMs")
    return "layers compiled by XLA:CPU on simulated devices (plan --search --target h100: the GPU's)"


def caveat_applies(res: Result) -> bool:
    """The fused-attention caveat is XLA:CPU's, where #1 runs cuDNN's flash kernel on a GPU (`run_kernels`): a layer
    compiled for a GPU runs that kernel, and a layout that runs XLA's holds the scores on a GPU too."""
    best = res.ranked[0].candidate if res.ranked else None
    return (res.config.attention == "fused" and res.target is None
            and (best is None or kernel_time.flash(run_kernels(res.config, best))))


def fused_attention_caveat(res: Result) -> str:
    """The working memory of `--attention fused` is XLA:CPU's, which materialises the scores a GPU's flash kernel
    never holds (`formulas.flash_attention_working_bytes`). Not subtracted: `memory_analysis()` gives one temp
    total, and how many score buffers are live at its peak is XLA's buffer assignment's choice, not readable from
    it (a second compile at another s would separate the s² part from the rest; the search does not)."""
    best = res.ranked[0].candidate if res.ranked else None
    line = ("caveat (--attention fused): working memory is the compiled XLA:CPU step's, which materialises the "
            "float32 [b, a/t, s/c, s] scores of a layer (no flash kernel on CPU); a GPU's flash kernel keeps a "
            f"{formulas.FLASH_TILE[0]}×{formulas.FLASH_TILE[1]} tile of them on chip and holds in HBM only the "
            "float32 dQ, log-sum-exp and rowsum(dO·O): 4·b·(a/t)·(s/c)·(d + 2) bytes per layer "
            "(formulas.flash_attention_working_bytes)")
    if best is None:
        return line
    flash = formulas.flash_attention_working_bytes(res.config, best.micro_batch, best.tensor, best.context)
    return (line + f"; for #1 ({best.label()}): one score buffer {flash['explicit_scores'] / 2**20:,.2f} MiB "
            f"(formula) counted in its working memory at least once, against the kernel's "
            f"{flash['hbm'] / 2**20:,.2f} MiB (formula): its memory is over-stated by at least the difference")


def to_json(res: Result, top: int = 10, pricing: cost.Pricing | None = None) -> dict:
    """The ranking's first `top` (each `Evaluated.to_json`, and with `pricing` its `days`, `gpu_hours` and `cost`,
    each {value, low, high}) and the request, the models' notes and the sources."""
    r, moe = res.request, bool(res.config.moe_experts)
    priced = (lambda e: {}) if pricing is None else (lambda e: row_cost(res, e, pricing))
    return {
        "model": res.model, "family": res.config.family, "hidden": res.config.hidden, "heads": res.config.heads,
        "kv_heads": res.config.num_kv_heads, "mlp_hidden": res.config.mlp_hidden, "layers": res.config.layers,
        "seq_len": res.config.seq_len, "vocab_size": res.config.vocab_size, "dtype": res.config.dtype,
        "gpus": r.gpus, "global_batch": r.global_batch, "hardware": asdict(r.hardware),
        "time_model": asdict(r.time_model), "micro_batches": list(r.micro_batches), "remats": list(r.remats),
        "context_sizes": list(r.context_sizes), "fsdp_sizes": list(r.fsdp_sizes), "schedules": list(r.schedules),
        "context_strategies": list(r.context_strategies), "fp8": list(r.fp8),
        **({"expert_sizes": list(r.expert_sizes), "moe_experts": res.config.moe_experts} if moe else {}),
        "evaluated": res.evaluated, "fitting": len(res.ranked), "measured_layer_programs": res.compiled,
        "memory_accounting": MEMORY_ACCOUNTING,
        "units": "memory GiB per device (first pipeline stage), time seconds per step, TFLOP/s per GPU (model FLOPs)",
        "ranked": [{**e.to_json(moe), **priced(e)} for e in res.ranked[:top]],
        "pricing": None if pricing is None else {"tokens": pricing.tokens,
                                                 "price_per_gpu_hour": pricing.price_per_gpu_hour,
                                                 "band": asdict(_band(res)), "source": "planning/cost.py"},
        "over_budget_by_compiled_step": [e.to_json(moe) for e in res.over_budget],
        "rejected_families": res.rejected_families,
        "fused_attention_caveat": fused_attention_caveat(res) if caveat_applies(res) else None,
        "memory_source": memory_source(res),
        "memory_bound_source": memory_bound_source(res),
    }
