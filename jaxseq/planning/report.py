"""The plan as text: the per-configuration table, the whole-model lines, the first stage's in-flight
activations, the training state with and without the distributed optimizer, and the budget's choice."""

from __future__ import annotations

from jaxseq.models import experts, model
from jaxseq.parallel.schedule import paper_bubble_formula
from jaxseq.planning.memory import GIB, MIB
from jaxseq.planning import host_tier
from jaxseq.planning.plan import CPU_SOURCE, FLOPS_SOURCE, Plan
from jaxseq.planning.recommend import chunk_layers, recommend
from jaxseq.remat import block_spec


NO_FORMULA = "n/a"  # the formula and ratio of a row no formula counts (JSON: null)


def _fmt(x, spec, missing=NO_FORMULA):
    return missing if x is None else format(x, spec)


def _pct(pct: float) -> float:
    """A percentage as printed to two decimals: −0.004 is 0.00, not −0.00."""
    return pct if round(pct, 2) else 0.0


def recompute_text(pct: float, unit: str = "") -> str:
    """A row's measured recompute overhead: below 0 it is labelled as what it is, XLA:CPU's FLOP count of the
    policy's program under `none`'s program's (compiled differently), not a cost the policy adds."""
    if round(pct, 2) < 0:
        return f"{pct:+.2f}%{unit} measured (XLA:CPU's count, below none's program's: not a cost)"
    return f"{_pct(pct):+.2f}%{unit}"


def _unit(largest: float, units: list[tuple[str, float]]) -> tuple[str, float]:
    """The largest unit in which `largest` is at least 1 (small test shapes print in KiB, not 0.0 MiB)."""
    return next(((n, u) for n, u in units if largest >= u), units[-1])


BYTES_LAYER = [("MiB", MIB), ("KiB", 2**10)]
BYTES_MODEL = [("GiB", GIB), ("MiB", MIB), ("KiB", 2**10)]
FLOP_UNITS = [("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)]


def format_table(p: Plan) -> str:
    """The rows, the FLOPs lines, the whole model per device, the first stage's in-flight activations
    (with a pipeline) and the training state."""
    cfg = p.config
    lines = [
        f"{p.model}: h={cfg.hidden} a={cfg.heads}"
        f"{model.shape_label(cfg)} L={cfg.layers} s={cfg.seq_len} V={cfg.vocab_size} "
        f"micro-batch={p.micro_batch} tensor={p.tensor}"
        f"{f' context={p.context} ({p.context_strategy})' if p.context > 1 else ''} {cfg.dtype} {cfg.attention} "
        f"attention (5as/h = {5 * cfg.heads * cfg.seq_len / cfg.hidden:g})",
        "per layer per device; stored = bytes kept for backward, read from the compiled program; "
        "collectives at the activation dtype, forward + backward",
        _flops_label(p),
        *_formula_label(p),
        "",
        *_format_rows(p),
        *_row_notes(p),
        *format_gemms(p),
        *format_context(p),
        "",
        _format_formula_flops(p),
    ]
    if p.tensor > 1:
        lines += _format_measured_headlines(p)
    lines.append(_format_whole_model(p))
    lines += format_host_tier(p)
    if p.in_flight is not None:
        lines += format_in_flight(p)
    lines += ["", *format_optimizer_state(p)]
    if p.pipeline > 1:
        lines += ["", *format_stage_state(p)]
    return "\n".join(lines)


def _format_rows(p: Plan) -> list[str]:
    """One line per configuration, each column in the largest unit its biggest value reaches."""
    bl, bu = _unit(max(r.measured_bytes_per_layer for r in p.rows), BYTES_LAYER)
    cl, cu = _unit(max(r.collective_bytes_per_layer for r in p.rows), BYTES_LAYER)
    fl, fu = _unit(max(r.flops_per_layer for r in p.rows), FLOP_UNITS)
    al, au = _unit(max(r.activation_bytes_per_device for r in p.rows), BYTES_MODEL)
    wl, wu = _unit(max(abs(r.working_bytes_per_device) for r in p.rows), BYTES_MODEL)  # negative where the step reuses
    tl, tu = _unit(max(r.total_bytes_per_device for r in p.rows), BYTES_MODEL)
    lines = [f"{'config':<22}{'remat':<14}{'SP':<4}{'t':>3}{'stored ' + bl:>12}{'formula ' + bl:>13}{'ratio':>8}"
             f"{fl:>9}{'recompute':>11}{'coll. ' + cl:>11}{'activ. ' + al:>12}{'work. ' + wl:>11}{'total ' + tl:>11}"]
    for r in p.rows:
        formula = None if r.formula_bytes_per_layer is None else r.formula_bytes_per_layer / bu
        lines.append(
            f"{r.config:<22}{r.remat:<14}{'yes' if r.sequence_parallel else 'no':<4}{r.tensor:>3}"
            f"{r.measured_bytes_per_layer / bu:>12.1f}{_fmt(formula, '.1f'):>13}"
            f"{_fmt(r.ratio, '.4f'):>8}{r.flops_per_layer / fu:>9.4f}{_pct(r.recompute_overhead_pct):>10.2f}%"
            f"{r.collective_bytes_per_layer / cu:>11.1f}{r.activation_bytes_per_device / au:>12.2f}"
            f"{r.working_bytes_per_device / wu:>11.2f}{r.total_bytes_per_device / tu:>11.1f}")
    return lines


def _flops_label(p: Plan) -> str:
    """Where the FLOP and recompute columns come from: XLA:CPU's count, with --target too."""
    gpu = (f", not the {p.target}'s (its programs, compiled without a GPU, count no FLOPs)" if p.target else "")
    return f"FLOPs and recompute (over `none`'s FLOPs at the same t and SP): {FLOPS_SOURCE}{gpu}"


def _row_notes(p: Plan) -> list[str]:
    """What a missing formula and a recompute below 0 mean, where a row has one."""
    lines = []
    if any(r.formula_bytes_per_layer is None for r in p.rows):
        lines.append(f"formula, ratio {NO_FORMULA}: no formula counts that row's tensors (the paper's Table 2 counts "
                     "its seven rows, formulas.activation_bytes explicit attention's); null in --json")
    below = [f"{r.config} {r.recompute_overhead_pct:+.2f}%" for r in p.rows if round(r.recompute_overhead_pct, 2) < 0]
    if below:
        lines.append(f"recompute below 0 ({', '.join(below)}): XLA:CPU counted fewer FLOPs in that policy's program "
                     "than in `none`'s, compiled differently (what an untagged fused attention keeps or replays, the "
                     "fusions): a count, not a cost; --budget-gib ranks by what a policy replays first")
    return lines


def format_gemms(p: Plan) -> list[str]:
    """With a target: the GEMMs each row's whole step runs per step on the GPU and their FLOPs, of which FP8 GEMMs
    (cuBLASLt's `__cublas$lt$matmul$f8`); with --fp8, what FP8 adds to each row's memory and the FP8 copies its
    layers make."""
    rows = [r for r in p.rows if r.gemms_per_step is not None]
    if not rows:
        return []
    counts = ", ".join(f"{r.config} {r.fp8_gemms_per_step}/{r.gemms_per_step} ({r.fp8_gemm_flops_per_step / 1e9:,.1f}/"
                       f"{r.gemm_flops_per_step / 1e9:,.1f} GFLOP)" for r in rows)
    lines = ["", f"GEMMs per step in each row's whole train step compiled for the {p.target}, FP8/all and their GFLOP "
                 f"per device (hlo_flops.gemm_count): {counts}"]
    for r in (r for r in rows if r.fp8_extra_bytes_per_device is not None):
        copies = ", ".join(f"{kind} {b / MIB:,.1f} MiB" for kind, b in sorted(r.fp8_copy_bytes_per_layer.items()))
        lines.append(f"FP8 {r.config}: the step's peak {r.fp8_extra_bytes_per_device / MIB:+,.1f} MiB against the "
                     f"same step in bf16 (in work.: the FP8 copies and scalar scales its layers hold for a moment, "
                     f"none kept from forward to backward); the FP8 copies one layer's loops write per "
                     f"micro-batch: {copies}")
    return lines


def format_context(p: Plan) -> list[str]:
    """With context parallelism: the K/V held for a moment (not divided by c) and moved per layer, from
    formulas.context_kv_bytes, and where the transient is in the totals."""
    if p.context <= 1:
        return []
    kv = p.context_kv
    unit, scale = _unit(max(kv.values()), BYTES_LAYER)
    held = ("gathered K and V of the whole sequence" if p.context_strategy == "all-gather"
            else "two K/V blocks of s/c tokens")
    return ["", f"context={p.context} {p.context_strategy}, per layer per device (formulas.context_kv_bytes, "
                f"{_kv_heads(p)}): transient {held}: forward {kv['transient'] / scale:.1f} {unit}, backward's peak "
                f"(with their gradients) {kv['transient_backward'] / scale:.1f} {unit}, not divided by c; in the "
                f"totals through work. (the compiled step at context={p.context}); K/V traffic sent, forward + "
                f"backward: {kv['traffic'] / scale:.1f} {unit}"]


def _kv_heads(p: Plan) -> str:
    cfg = p.config
    return f"{max(cfg.num_kv_heads, p.tensor) // p.tensor} K/V heads per tensor rank × d={cfg.head_dim}, {cfg.dtype}"


def _formula_label(p: Plan) -> list[str]:
    """Which formula the formula column is where it is not the paper's Table 2 (GPT's)."""
    if p.config.moe_experts:  # `plan.formula_bytes_per_layer`: the attention half's terms and the MoE MLP's
        return [f"formula = formulas.moe_activation_bytes, term by term: the Llama attention half's tensors"
                f"{f' at context={p.context}' if p.context > 1 else ''} and the MoE MLP's (formulas.moe_tensor_bytes: "
                f"router logits, routing, dispatched and combined buffers, the experts' hidden activations at "
                f"{_capacity(p)}; docs/DESIGN.md, \"Stored bytes of a mixture of experts' layer\")"]
    if p.context > 1:
        return [f"formula = formulas.activation_bytes at context={p.context} ({p.context_strategy}), term by term: "
                "every stored tensor / c" + (", no scores, + the ring's log-sum-exp (ring_lse)"
                                             if p.context_strategy == "ring" else "; the gathered K/V not stored")]
    if model.traits(p.config).papers_formulas:
        return []
    return [f"formula = formulas.activation_bytes for the {p.config.family} family, term by term (docs/DESIGN.md, "
            "\"Stored bytes per layer, by family\"; norm statistics included), not the paper's Table 2"]


def _capacity(p: Plan) -> str:
    """A mixture's slots per expert for the plan's routing group of b·s/c tokens, in words."""
    cfg, tokens = p.config, p.micro_batch * p.config.seq_len // p.context
    rule = "dropless" if cfg.moe_capacity_factor is None else f"capacity factor {cfg.moe_capacity_factor}"
    return f"C = {experts.capacity(tokens, cfg)} slots per expert of a group of T = {tokens} tokens ({rule})"


def _format_formula_flops(p: Plan) -> str:
    """The formulas' FLOPs per layer: model, and hardware with selective and with full recompute."""
    f, cfg = p.formula_flops_per_layer, p.config
    selective_pct = 100 * (f["hardware_selective"] / f["model"] - 1)
    full_pct = 100 * (f["hardware_full"] / f["model"] - 1)
    if not model.traits(cfg).papers_formulas:
        mlp = ("a mixture's k experts a token and its router, not the capacity's padding: formulas.moe_matmul_flops"
               if cfg.moe_experts else "the MLP's gate, up and down")
        return (f"FLOPs per layer per device (t={p.tensor}), formulas.train_flops ({cfg.family}: K/V heads counted "
                f"once, {mlp}): model {f['model'] / 1e12:.4f} TFLOP; hardware with selective "
                f"{f['hardware_selective'] / 1e12:.4f} (+{selective_pct:.2f}%); with full "
                f"{f['hardware_full'] / 1e12:.4f} (+{full_pct:.2f}%)")
    attention_share_pct = 100 * cfg.seq_len / (6 * cfg.hidden)  # the paper's s/(6h)
    return (f"FLOPs per layer per device (t={p.tensor}): paper model {f['model'] / 1e12:.4f} TFLOP; hardware with "
            f"selective {f['hardware_selective'] / 1e12:.4f} (+{selective_pct:.2f}%, s/(6h) = "
            f"{attention_share_pct:.2f}%); with full {f['hardware_full'] / 1e12:.4f} (+{full_pct:.2f}%)")


def _format_measured_headlines(p: Plan) -> list[str]:
    """With tensor parallelism: what full recompute adds, what TP+SP+selective stores, and (fused
    attention) how little selective saves."""
    cfg = p.config
    full, tp, sp_sel = p.row("full"), p.row("tp"), p.row("tp+sp+selective")
    extra = full.flops_per_layer - tp.flops_per_layer  # what full recompute adds
    expected = p.forward_flops_per_layer - p.last_matmul_flops_per_layer  # forward but its last matmul
    difference = extra - expected
    lines = [
        f"measured: forward {p.forward_flops_per_layer / 1e12:.4f} TFLOP per layer; full recompute adds "
        f"{extra / 1e12:.4f} TFLOP = forward − last matmul ({p.last_matmul_flops_per_layer / 1e12:.4f}) "
        f"{'+' if difference >= 0 else '−'} {abs(difference) / 1e9:.1f} GFLOP"]
    stored_ratio = sp_sel.measured_bytes_per_layer / tp.measured_bytes_per_layer
    lines.append(f"TP+SP+selective stores {stored_ratio:.3f} × TP ({1 / stored_ratio:.1f}× less); "
                 f"full+sp / (2sbh/t) = {_fmt(p.row('full+sp').ratio, '.4f')}; selective recompute overhead "
                 f"{recompute_text(sp_sel.recompute_overhead_pct)}"
                 + (" (JAX recomputes QKᵀ and softmax, not scores×V)" if cfg.attention == "explicit" else ""))
    if cfg.attention == "fused":
        none = p.row("tp+sp")
        saved = none.measured_bytes_per_layer - sp_sel.measured_bytes_per_layer
        saved_pct = 100 * saved / none.measured_bytes_per_layer
        lines.append(f"fused attention stores no scores: selective saves only {saved / MIB:.1f} MiB per layer "
                     f"over none with SP ({saved_pct:.1f}%); "
                     "the paper's formulas assume the explicit scores. Even `none` recomputes the attention "
                     "internals here (untagged), and no attention-probs dropout is applied")
    return lines


def _memory_sources(p: Plan) -> str:
    """Where the rows' memory figures come from: one source, or each with the rows that read it (a recorded file of
    GEMM choices can hold some rows' steps and not others')."""
    rows = {}
    for r in p.rows:
        rows.setdefault(r.memory_source, []).append(r.config)
    if len(rows) == 1:
        return next(iter(rows))
    return "; ".join(f"{', '.join(names)}: {source}" for source, names in rows.items())


def _format_whole_model(p: Plan) -> str:
    """The state per device in GiB (of the first stage with a pipeline) and what the other columns hold."""
    cfg, t = p.config, p.tensor
    state = next(r for r in p.rows if r.tensor == t)
    stage = "" if p.pipeline == 1 else (f", first of {p.pipeline} pipeline stages: {-(-cfg.layers // p.pipeline)} "
                                        f"layers' state, {p.in_flight_layers:g} layers' activations ({p.schedule}, "
                                        f"compiled)")
    return (
        f"whole model per device (t={t}, d={p.data}{f', fsdp={p.fsdp}' if p.fsdp > 1 else ''}{stage}"
        f"{', distributed optimizer' if p.distributed_optimizer else ''}): fp32 master weights "
        f"{state.params_bytes_per_device / GIB:.1f} GiB, gradients {state.gradient_bytes_per_device / GIB:.1f} GiB, "
        f"Adam moments {state.optimizer_bytes_per_device / GIB:.1f} GiB, {cfg.dtype} weight copy "
        f"{state.weight_copy_bytes_per_device / GIB:.1f} GiB (from shapes); activations = "
        f"stored/layer × in-flight layers + embedding/logits part from shapes (4·s·b·V/t f32 logits, LN input, masks); "
        f"working = "
        + (f"the rest of the whole train step's peak. Stored, activ., work. and total: {_memory_sources(p)}"
           if state.memory_source != CPU_SOURCE else
           "the compiled float32 step's other temporaries (one layer's backward, the logits' gradient, RNG bits)"
           + (f" + FSDP's gathered weights, {state.fsdp_gathered_bytes_per_device / GIB:.2f} GiB (one layer's, or "
              "the largest embedding table's, in the compute dtype with its float32 gradient: from shapes)"
              if p.fsdp > 1 else "")
           + ("; for bfloat16 an upper bound (only its float32 transients keep their size on a GPU: "
              "plan --target h100 compiles the GPU's program)" if cfg.dtype != "float32" else "")))


def format_host_tier(p: Plan) -> list[str]:
    """With --offload / --offload-optimizer: per row what it keeps in host memory and moves over PCIe per step."""
    if p.pcie_gb_per_s is None:
        return []
    source = (f"host bytes and total: the {p.target} program's own" if p.target is not None else
              "host bytes: the formula (planning/host_tier.py), total: the row's less them (XLA:CPU offloads nothing)")
    lines = [f"host memory (--offload{'/--offload-optimizer' if any(r.offload_optimizer for r in p.rows) else ''}): "
             f"total above is the device's; per row the bytes in host memory, PCIe bytes and seconds per step at "
             f"{p.pcie_gb_per_s:g} GB/s per direction × {host_tier.PCIE_EFFICIENCY} (data sheet × the link "
             f"efficiency); {source}; {host_tier.OVERLAP}"]
    for r in p.rows:
        names = ", ".join(r.offload) if r.offload else "no activations"
        lines.append(f"  {r.config:<22}host {r.host_bytes_per_device / MIB:>10.1f} MiB  PCIe "
                     f"{r.pcie_bytes_per_step / 1e6:>10.1f} MB/step {r.pcie_seconds_per_step:>8.4f} s  ({names}"
                     f"{' + optimizer state' if r.offload_optimizer else ''})")
    return lines


def format_in_flight(p: Plan) -> list[str]:
    """The first stage's in-flight activations: compiled, scaled, and the paper's formula; and the bubble."""
    f, pp, v, m = p.in_flight, p.pipeline, p.virtual_stages, p.microbatches
    row = p.row(f.config)
    unit, u = _unit(f.compiled_stash_bytes, BYTES_MODEL)
    big, bu = _unit(f.stash_bytes, BYTES_MODEL)
    layer, lu = _unit(row.measured_bytes_per_layer, BYTES_LAYER)
    formula = paper_bubble_formula(p.schedule, v)
    deferred = []
    if f.w_slots:
        w, wu = _unit(f.compiled_w_stash_bytes, BYTES_MODEL)
        deferred = [f"  W stash   compiled {f.w_slots} slots × {f.compiled_layers_per_chunk} layers = "
                    f"{f.compiled_w_stash_bytes / wu:.2f} {w} (each B's weight-matmul inputs and output gradients, "
                    f"kept until its W); scaled to {f.layers_per_chunk} layers per chunk: "
                    f"{f.w_stash_bytes / bu:.2f} {big}, in the activ. column "
                    f"({row.deferred_stash_bytes_per_device / bu:.2f} {big} for {f.config}: the formula)"]
    return [
        f"pipeline {p.schedule}: p={pp} v={v} m={m}, first stage's in-flight activations ({f.config}):",
        f"  compiled  {f.slots} stash slots × {f.compiled_layers_per_chunk} layers = "
        f"{f.compiled_stash_bytes / u:.2f} {unit} ({f.per_layer_bytes / lu:.2f} {layer} per layer; the unpipelined "
        f"layer stores {row.measured_bytes_per_layer / lu:.2f} {layer}); received-activation/gradient buffers "
        f"{f.receive_bytes / u:.2f} {unit}",
        f"  scaled    to {f.layers_per_chunk} layers per chunk: {f.slots} × {f.layers_per_chunk} = {f.layers} layers' "
        f"worth = {f.stash_bytes / bu:.2f} {big} (the activ. column: each row's stored/layer × {f.layers})",
        f"  formula   the paper's {f.formula} = {f.formula_layers:g} layers",
        *deferred,
        f"  source    {f.source}",
        f"  bubble    {p.bubble:.4f} (idle/busy ticks of the lock-step tick table) vs {formula} = {p.paper_bubble:.4f}",
        *_bubble_in_time(p),
    ]


def _bubble_in_time(p: Plan) -> list[str]:
    """The bubble at the compiled tick branches' dot FLOPs, lock-step, beside 1F1B's at the same costs."""
    f = p.in_flight
    if not f.branch_dot_flops:
        return []
    c = f.branch_dot_flops
    costs = " / ".join(f"{c[k] / 1e9:.3g}" for k in ("F", "B", "W")) + " GFLOP (F / B / W"
    return [f"  in time   {1 + f.lockstep_bubble:.4f} × the ideal m·v·(F + B + W) per stage (bubble "
            f"{f.lockstep_bubble:.4f}) at the tick branches' dot FLOPs per device, {costs}: "
            f"compiled, per {f.compiled_layers_per_chunk} layers), each tick waiting for its slowest stage as the "
            f"executor runs; 1F1B at the same costs: {1 + f.lockstep_bubble_1f1b:.4f} × the ideal"]


STATE_LABELS = {"weight_copy": "{dtype} weight copy", "gradients": "fp32 gradients",
                "master_weights": "fp32 master weights", "adam_moments": "Adam moments (2 × fp32)", "total": "total"}


def format_optimizer_state(p: Plan) -> list[str]:
    """The state per device without and with the distributed optimizer, in bytes per parameter
    (of the parameters on one device) and in total."""
    both = p.optimizer_state()
    without, with_it = both["without_distributed_optimizer"], both["with_distributed_optimizer"]
    unit, scale = _unit(without["bytes_per_device"]["total"], BYTES_MODEL)
    used = "with" if p.distributed_optimizer else "without"
    over = "data" if p.context == 1 else f"data × context = {p.data * p.context}"
    lines = [f"training state per device (t={p.tensor}, d={p.data}{f', c={p.context}' if p.context > 1 else ''}"
             f"{f', fsdp={p.fsdp}' if p.fsdp > 1 else ''}, "
             f"{p.parameters_per_device / 1e6:,.1f}M parameters "
             f"per device; the totals above use: {used}):",
             f"  {'':<22}{'without B/param':>16}{'with B/param':>14}{'without ' + unit:>14}{'with ' + unit:>11}"]
    for key, label in STATE_LABELS.items():
        label = label.format(dtype=p.config.dtype)
        lines.append(f"  {label:<22}{without['bytes_per_parameter'][key]:>16.2f}"
                     f"{with_it['bytes_per_parameter'][key]:>14.2f}"
                     f"{without['bytes_per_device'][key] / scale:>14.2f}"
                     f"{with_it['bytes_per_device'][key] / scale:>11.2f}")
    lines.append(f"  with: master weights and moments split over {over} (--distributed-optimizer); the weight copy is "
                 f"gathered over {over} once per step; gradients are full during backward, then reduce-scattered")
    if p.fsdp > 1:
        lines.append(f"  both: every weight's master, moments and gradient split over fsdp={p.fsdp} (FSDP); no weight "
                     "copy is kept: each layer casts and gathers its weights as it runs (biases and norm scales whole)")
    return lines


def format_stage_state(p: Plan) -> list[str]:
    """With a pipeline: the state each device holds by part, its layers and the embedding group, beside what
    Megatron-LM's first stage holds of that group (its last stage the same, its middle stages none)."""
    parts, cfg = p.stage_state(), p.config
    unit, scale = _unit(parts["layers"]["total"], BYTES_MODEL)
    stage_layers = -(-cfg.layers // p.pipeline)
    lines = [f"state per device on every pipeline stage (p={p.pipeline}; one SPMD program: each stage holds what "
             f"stage 0 holds), {unit}, as the totals above count it:",
             f"  {'':<24}{f'{stage_layers} layers':>12}{'embedding group':>22}{'Megatron first/last stage':>27}"]
    for key, label in STATE_LABELS.items():
        lines.append(f"  {label.format(dtype=cfg.dtype):<24}{parts['layers'][key] / scale:>12.2f}"
                     f"{parts['embedding_group'][key] / scale:>22.2f}"
                     f"{parts['megatron_first_stage_embedding_group'][key] / scale:>27.2f}")
    saved = parts["megatron_first_stage_embedding_group"]["total"] - parts["embedding_group"]["total"]
    lines.append(f"  the embedding group (embedding, final norm, an untied head) is whole on every stage for compute "
                 f"(the first stage's lookup "
                 f"and the last stage's logits need them inside the tick loop); their master weights and moments are "
                 f"split over pipe, so the first stage, which sets the peak, holds {saved / scale:.2f} {unit} less of "
                 f"them than Megatron-LM's (whose middle stages hold none)")
    return lines


def format_recommendation(p: Plan, budget_gib: float) -> str:
    chosen, rejected = recommend(p, budget_gib * GIB)
    lines = [f"budget {budget_gib:g} GiB per device, tensor={p.tensor}, pipeline={p.pipeline}, data={p.data} "
             f"{'with' if p.distributed_optimizer else 'without'} the distributed optimizer, "
             f"micro-batch={p.micro_batch}; by what each policy replays (none; a part of the forward; full: "
             f"recommend.replay_rank), then by measured recompute ({FLOPS_SOURCE}):"]
    for r, why in rejected:
        lines.append(f"  {r.config:<22} does not fit: {why} (recompute {recompute_text(r.recompute_overhead_pct)})")
    if chosen is None:
        hint = "" if p.distributed_optimizer or p.data == 1 else ", or --distributed-optimizer"
        lines.append(f"  nothing fits: more tensor/pipeline parallelism or a smaller micro-batch is needed{hint}")
    else:
        lines.append(f"  recommended: {chosen.config} (remat={chosen.remat}, sequence_parallel="
                     f"{chosen.sequence_parallel}): {chosen.total_bytes_per_device / GIB:.1f} GiB, recompute "
                     f"{recompute_text(chosen.recompute_overhead_pct, ' FLOPs')}")
        block = block_spec(chosen.remat)
        if block:
            megatron = (f" (Megatron-LM: --recompute-granularity full --recompute-method block --recompute-num-layers "
                        f"{block[1]})" if block[2] == "none" else "")
            lines.append(f"    block recompute: {block[1]} of each chunk's {chunk_layers(p)} layers under {block[0]}, "
                         f"the rest under {block[2]}: train with --remat {chosen.remat}{megatron}; its memory "
                         f"{chosen.memory_source}")
    return "\n".join(lines)
