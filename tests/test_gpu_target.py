"""Compiling for a GPU on this CPU-only machine (`plan --target`, planning/gpu_target.py): XLA:GPU's own memory
accounting against the peaks an H100 measured (experiments/results/gpu_h100_2026-11-26/), float32 with fused
attention on XLA's kernel, and eight target devices' NCCL collectives under tensor parallelism + SP."""

import inspect
import json
import re
from pathlib import Path

import jax
import pytest

from jaxseq.config import ConfigError, ModelConfig, ParallelConfig, replace
from jaxseq.models.model import saved_model_fields
from jaxseq.presets import preset
from jaxseq.planning import gpu_target as G
from jaxseq.planning import hlo, hlo_collectives, hlo_flops, hlo_kernels, kernel_time
from jaxseq.planning import search_memory
from jaxseq.planning.costs import costs_of, run_kernels
from jaxseq.planning.search_space import Candidate, TimeModel
from jaxseq.planning.search_time import program_compute_seconds
from jaxseq.training import aot

pytest.importorskip("jax_cuda12_plugin", reason="the CUDA plugin: pip install -r requirements-gpu-target.txt")

MEASURED = Path(__file__).resolve().parents[1] / "experiments" / "results" / "gpu_h100_2026-11-26"
CUDNN_ATTENTION = hlo.CUDNN_ATTENTION


pytestmark = pytest.mark.usefixtures("no_persistent_cache")  # conftest.py: target programs are not loaded back


def _measured(name: str) -> dict:
    """model name → its config, micro-batch and each policy's peak_bytes_in_use, as experiments/gpu.py recorded."""
    (model,) = json.loads((MEASURED / f"h100_{name}_mb4.json").read_text())["models"].values()
    return model


@pytest.mark.parametrize("name,remat", [("gpt3-1.3b", "none"),
                                        pytest.param("gpt3-1.3b", "lean", marks=pytest.mark.slow),
                                        pytest.param("llama-1b", "selective", marks=pytest.mark.slow),
                                        ("llama-1b", "full")])
def test_the_h100_programs_peak_is_within_3_percent_of_the_measured_one(name, remat):
    """The whole donated train step compiled for an H100 here, against `memory_stats()["peak_bytes_in_use"]` of the
    same configuration on an H100 (JAX 0.11.2, cuDNN attention). XLA:CPU's plan of the same is 15–40% above."""
    model = _measured(name)
    cfg = ModelConfig(**saved_model_fields(model["config"]))
    compiled = G.compile_step(cfg, ParallelConfig(), remat, model["micro_batch"], 1, "h100")
    measured = model["policies"][remat]["peak_bytes_in_use"]
    assert abs(aot.step_bytes(compiled) / measured - 1) < 0.03, (aot.step_bytes(compiled), measured)
    assert CUDNN_ATTENTION in compiled.as_text()  # bf16 fused attention is cuDNN's, as on the GPU


LATER = MEASURED.parent / "gpu_h100_2026-11-27"  # the H100 again, at other micro-batches (experiments/gpu_followup.py)


@pytest.mark.parametrize("remat,micro_batch", [("full", 32), pytest.param("none", 8, marks=pytest.mark.slow)])
def test_a_steps_peak_is_the_larger_of_its_triton_and_cublas_programs(remat, micro_batch):
    """Without a device XLA makes every GEMM a Triton fusion; the device's autotuner chose cuBLAS for gpt3-1.3b's
    LM head at micro-batch 32, whose f32 logits Triton's fusion had taken into its epilogue: the H100 peaked at
    41.2 GiB, the Triton program says 35.3. `step_bytes` is the larger of both programs, within 3% of the peak."""
    (model,) = json.loads((LATER / "gpu.json").read_text())["models"].values()
    cfg = ModelConfig(**saved_model_fields(model["config"]))
    run = json.loads((LATER / "followup_1.json").read_text())["runs"][f"{remat}_micro_batch_{micro_batch}"]
    measured = run["peak_bytes_in_use"]
    peaks = {g: aot.step_bytes(G.compile_step(cfg, ParallelConfig(), remat, micro_batch, 1, "h100", g))
             for g in G.GEMMS}
    assert abs(max(peaks.values()) / measured - 1) < 0.03, (peaks, measured)
    if micro_batch == 32:
        assert peaks["triton"] / measured < 0.9 and peaks["cublas"] > peaks["triton"]


def test_float32_with_fused_attention_compiles_for_the_gpu_with_xlas_kernel():
    """cuDNN has no float32 attention (the GPU run's NotImplementedError): float32 takes XLA's kernel."""
    cfg = replace(preset("tiny"), attention="fused", dtype="float32")
    text = G.compile_step(cfg, ParallelConfig(), "selective", 2, 1, "h100").as_text()
    assert CUDNN_ATTENTION not in text and "f32[" in text


def test_tensor_8_with_sp_on_eight_h100s_compiles_its_nccl_collectives():
    cfg = replace(preset("tiny"), attention="fused")
    compiled = G.compile_step(cfg, ParallelConfig(tensor=8, sequence_parallel=True), "selective", 2, 1, "h100")
    ops = set(re.findall(r"\b((?:all-gather|reduce-scatter|all-reduce)-start)\(", compiled.as_text()))
    # SP's all-gather before and reduce-scatter after each block, and the tensor-parallel all-reduce (the
    # vocabulary-parallel loss): NCCL's asynchronous start/done pairs, as XLA:GPU schedules them
    assert ops == {"all-gather-start", "reduce-scatter-start", "all-reduce-start"}, ops
    assert compiled.memory_analysis() is not None


def test_fsdp_compiles_for_eight_h100s_gathering_bf16_and_reducing_float32():
    """FSDP's step (fsdp=4 × tensor=2 + SP, bf16) in XLA:GPU's program, where nothing promotes a bf16 collective:
    every all-gather over the fsdp groups moves the compute dtype (each shard cast before its gather: half the
    float32 master's bytes), and every reduction over them float32 (the layers' gradient reduce-scatters among
    them, in the layer loop)."""
    import numpy as np

    from jaxseq.mesh import make_mesh

    parallel = ParallelConfig(fsdp=4, tensor=2, sequence_parallel=True)
    cfg = replace(preset("tiny"), dtype="bfloat16", dropout=0.0)
    text = G.compile_step(cfg, parallel, "selective", 2, 1, "h100").as_text()
    mesh = make_mesh(parallel, G.target_devices("h100", 8))
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    fsdp = {tuple(sorted(g)) for g in np.moveaxis(ids, mesh.axis_names.index("fsdp"), -1).reshape(-1, 4).tolist()}
    gathers = hlo_collectives.all_gathers(text, 4)
    assert gathers and {g.dtype for g in gathers} == {"bf16"} and any(g.in_loop for g in gathers)
    over_fsdp = [r for r in hlo_collectives.reductions(text)
                 if r.groups and {tuple(sorted(g)) for g in r.groups} == fsdp]
    assert any(r.kind == "reduce-scatter" and r.in_loop for r in over_fsdp)
    assert {d for r in over_fsdp for d in r.dtypes} == {"f32"}, over_fsdp


def test_the_distributed_optimizer_gathers_the_compute_copy_not_the_float32_masters():
    """data=4 × tensor=2 + SP, bf16, the distributed optimizer, compiled for eight H100s: every weight's all-gather
    over data moves the bf16 compute copy, each rank's master shard cast before it is gathered (Megatron's 2 bytes
    a parameter); only the parameters that stay float32 (the norms') are gathered in float32. Left to the
    partitioner the masters were gathered in float32 and cast after, twice the bytes."""
    import numpy as np

    from jaxseq.models import model as M

    parallel = ParallelConfig(data=4, tensor=2, sequence_parallel=True, distributed_optimizer=True)
    cfg = replace(preset("tiny"), dtype="bfloat16", dropout=0.0)
    gathers = hlo_collectives.all_gathers(G.compile_step(cfg, parallel, "selective", 2, 1, "h100").as_text(), 4)
    shapes = jax.tree.leaves(M.param_shapes(cfg, 2), is_leaf=lambda x: isinstance(x, tuple))
    size = lambda dims: int(np.prod(dims))
    largest_float32 = max(size(d) for d, cast in zip(shapes, jax.tree.leaves(M.cast_mask(cfg))) if not cast)
    kernels = [size(d) for path, d in jax.tree_util.tree_leaves_with_path(M.param_shapes(cfg, 2),
                                                                            is_leaf=lambda x: isinstance(x, tuple))
               if path[-1].key == "kernel"]
    assert largest_float32 < min(kernels)  # the norms' against any kernel's
    assert max(size(g.dims) for g in gathers if g.dtype == "bf16") >= max(size(d) for d in shapes) // 2
    assert max(size(g.dims) for g in gathers if g.dtype != "bf16") <= largest_float32, gathers


def test_fsdps_layer_loops_carry_its_weight_and_gradient_stacks_as_they_are():
    """XLA:GPU lays out a collective's own dimension major. Gathering in place a weight split along a minor dimension
    (the MLP's output [f, h], the attention's output [heads, d, h]) made the layer loops carry those float32 master and
    gradient stacks transposed, so the step held a transposed copy beside each (352 MiB of 8.0 GiB at gpt3-1.3b's
    width, 8 layers, f = 2: experiments/results/search_memory.md). `fsdp.gather` gathers and reduce-scatters over a
    new leading axis instead: every stack over the layers the loops carry is laid out row-major, as the step's
    arguments are (one layer's gradient before its reduce-scatter may be carried in another layout: XLA pipelines
    the reduce-scatter into the next iteration)."""
    cfg = replace(preset("tiny"), dtype="bfloat16", attention="fused", layers=4)
    text = G.compile_step(cfg, ParallelConfig(fsdp=2), "selective", 2, 1, "h100").as_text()
    loops = [line.split(" while(")[0] for line in text.splitlines() if re.search(r"\) while\(", line)]
    assert len(loops) == 2  # the layer scan, forward and backward
    for carry in loops:
        stacks = [(dims, tuple(int(d) for d in layout.split(",")))
                  for dims, layout in re.findall(r"f32\[([0-9,]+)\]\{([0-9,]+)\}", carry) if dims.split(",")[0] == "4"]
        assert len(stacks) > 4 and all(layout == tuple(sorted(layout, reverse=True)) for _, layout in stacks), stacks


def _attention_kernels(text: str) -> tuple[int, int]:
    """(forward, backward) cuDNN attention calls in a compiled program's text."""
    calls = re.findall(r'custom_call_target="(__cudnn\$fmha\w*)"', text)
    return calls.count("__cudnn$fmhaSoftmax"), calls.count("__cudnn$fmhaSoftmaxBackward")


def test_cudnns_attention_compiles_in_the_data_fsdp_and_pipeline_regions_and_runs_forward_once():
    """cuDNN's attention, whose own partitioning fails inside jaxseq's data-parallel region (and FSDP's, the
    pipeline's), runs there nested manual over `tensor` (models/cudnn_attention.py) and compiles for H100s. Its
    residuals are tagged: a policy that keeps the context runs the forward kernel once per layer (one loop body
    each way), `full` twice (its replay); untagged, every policy ran it twice. The all-gather context strategy takes
    XLA's."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxseq.mesh import make_mesh

    cfg = replace(preset("tiny"), attention="fused")
    data = ParallelConfig(data=2)
    assert _attention_kernels(G.compile_step(cfg, data, "none", 2, 1, "h100").as_text()) == (1, 1)
    assert _attention_kernels(G.compile_step(cfg, data, "full", 2, 1, "h100").as_text()) == (2, 1)
    for parallel in (ParallelConfig(fsdp=2, tensor=2, sequence_parallel=True),
                     ParallelConfig(pipe=2, tensor=2, sequence_parallel=True, schedule="zb-h1")):
        assert CUDNN_ATTENTION in G.compile_step(cfg, parallel, "selective", 2, 2, "h100").as_text(), parallel
    assert CUDNN_ATTENTION not in G.compile_step(cfg, ParallelConfig(context=2), "selective", 2, 1, "h100").as_text()

    # JAX's kernel called as it is, in a region manual over `data`: still its partitioner's failure (when this
    # compiles, the nesting is no longer needed)
    mesh = make_mesh(ParallelConfig(data=2), G.target_devices("h100", 2))
    kernel = lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True, implementation="cudnn")
    region = jax.shard_map(lambda q: jax.grad(lambda q: kernel(q).astype("float32").sum())(q), mesh=mesh,
                           in_specs=P("data"), out_specs=P("data"), axis_names=frozenset({"data"}))
    q = jax.ShapeDtypeStruct((4, 128, 4, 64), "bfloat16", sharding=NamedSharding(mesh, P("data")))
    with pytest.raises(Exception, match="custom_partitioner"):
        jax.jit(region).lower(q).compile()


@pytest.mark.slow  # a plan: 6 CPU programs and 4 GPU ones
def test_a_plan_for_a_target_reads_each_rows_whole_step_compiled_for_it(devices):
    """`plan --target h100`: each row's stored bytes and total are XLA:GPU's, labelled so; the total is the row's
    whole train step compiled for the H100, the larger of its Triton and cuBLAS programs (FLOPs stay XLA:CPU's: a
    deviceless GPU compile has no cost analysis)."""
    from jaxseq.planning.plan import CPU_SOURCE, plan

    cfg = replace(preset("tiny"), attention="fused")
    on_gpu, on_cpu = (plan(cfg, 1, 2, devices, policies=("selective",), target=target) for target in ("h100", None))
    row, cpu_row = on_gpu.row("selective"), on_cpu.row("selective")
    assert row.memory_source.startswith("XLA:GPU h100") and cpu_row.memory_source == CPU_SOURCE
    assert row.total_bytes_per_device == G.step_bytes(cfg, ParallelConfig(), "selective", 2, 1, "h100")
    assert row.total_bytes_per_device != cpu_row.total_bytes_per_device
    assert row.flops_per_layer == cpu_row.flops_per_layer


@pytest.mark.slow  # two searches: their layers compiled for the GPU and by XLA:CPU
def test_a_search_for_a_target_measures_its_layers_from_the_gpus_programs(capsys):
    """`plan --search --target h100`: each layer compiled for the H100 (its memory XLA:GPU's: SP's collectives
    NCCL's, attention cuDNN's), labelled so, and no XLA:CPU caveat about fused attention's scores."""
    from jaxseq import plan

    argv = ["--search", "--preset", "tiny", "--gpus", "8", "--global-batch", "8", "--hardware", "h100",
            "--tensor-sizes", "2", "--context-sizes", "1", "--micro-batch-sizes", "1", "--remat-policies", "selective",
            "--attention", "fused", "--json"]
    assert plan.main(argv + ["--target", "h100"]) == 0
    on_gpu = json.loads(capsys.readouterr().out)
    assert plan.main(argv) == 0
    on_cpu = json.loads(capsys.readouterr().out)
    assert on_gpu["memory_source"].startswith("layers compiled for the h100 (XLA:GPU")
    assert on_gpu["fused_attention_caveat"] is None and on_cpu["fused_attention_caveat"] is not None
    assert on_gpu["memory_bound_source"].startswith("the memory-bound kernels of each layer's h100 program")
    assert on_cpu["memory_bound_source"].startswith("Megatron's elementwise kernels (counted)")
    gpu, cpu = on_gpu["ranked"][0], on_cpu["ranked"][0]
    assert gpu["memory_gib"]["state"] == cpu["memory_gib"]["state"]  # from shapes, as the search counts it
    assert gpu["memory_gib"]["working"] != cpu["memory_gib"]["working"]  # the programs' own
    # --verify (3 by default with --target): the best three held to their whole train steps compiled for the H100
    assert [e["compiled_step_gib"] is not None for e in on_gpu["ranked"][:4]] == [True, True, True, False]
    assert all(e["compiled_step_gib"] is None for e in on_cpu["ranked"])
    parallel = G.step_parallel(tensor=gpu["tensor"], sequence_parallel=gpu["sequence_parallel"], data=gpu["data"],
                               distributed_optimizer=gpu["distributed_optimizer"], pipeline=gpu["pipe"])
    cfg = replace(preset("tiny"), attention="fused")
    # The step of the best row, by the arguments its JSON gives (a step --verify did not compile is compiled here)
    planned, moved = G.step_costs(cfg, parallel, gpu["remat"], gpu["micro_batch"], gpu["microbatches"], "h100")
    assert gpu["compiled_step_gib"] * 2**30 == planned
    # GPU s: the step priced on that program (its memory-bound kernels' bytes), its collectives as the model's
    from dataclasses import fields

    from jaxseq.hardware import HARDWARE

    # a dense search's JSON rows leave out what only a mixture has (`expert`): those take their defaults
    c = Candidate(**{f.name: gpu[f.name] for f in fields(Candidate) if f.name in gpu})
    if c.pipe > 1:
        assert gpu["compiled_step_s"] is None
    else:
        t = gpu["time_s"]
        compute = program_compute_seconds(cfg, c, HARDWARE["h100"], TimeModel(), moved)
        assert gpu["compiled_step_s"] == pytest.approx(t["total"] - t["compute"] - t["optimizer_update"] + compute)


SEARCHED = replace(preset("tiny"), hidden=512, heads=8, vocab_size=1024, seq_len=256, layers=8, attention="fused")


@pytest.mark.parametrize("candidate", [
    Candidate(1, 1, 1, 1, 2, "none", False, False, 2),  # one GPU, two micro-batches accumulated
    pytest.param(Candidate(2, 1, 1, 2, 1, "lean", True, True, 1), marks=pytest.mark.slow),  # t=2 + SP, d=2, distopt
], ids=["accumulated", "tensor-sp-distopt"])
def test_a_searchs_memory_adds_up_to_the_whole_step_compiled_for_the_gpu(candidate):
    """`plan --search --target`'s memory, its parts added up (`search_memory.memory`: the state's share of the peak +
    stored × layers + working, its layer compiled for the H100 at two layers), within 3% of the whole train step
    compiled for the H100 at eight. The step peaks in its backward layer loop, which carries the compute copy's
    gradients in bf16 before any float32 one is made (`memory.State.at_peak`); counting float32 gradients there (2 bytes
    a parameter more), the parts came out more than 5% above it here, 8–14% at gpt3-1.3b's shape."""
    from jaxseq.config import on_platform
    from jaxseq.plan import candidate_parallel
    from jaxseq.planning.search_costs import SearchCosts

    cfg = on_platform(SEARCHED, "gpu")
    layer, state = costs_of(cfg, candidate, SearchCosts(cfg, G.target_devices("h100", 2)))
    parts = search_memory.memory(cfg, candidate, layer, state).total_bytes
    compiled = aot.step_bytes(G.compile_step(SEARCHED, candidate_parallel(candidate), candidate.remat,
                                             candidate.micro_batch, candidate.microbatches, "h100"))
    assert abs(parts / compiled - 1) <= 0.03, (parts, compiled)
    assert (parts + 2 * state.parameters) / compiled - 1 > 0.05, (parts, compiled)


def test_accumulating_holds_the_tables_compute_copy_beside_their_gradients():
    """Llama 3 8B's width at 4 layers (two 1,002 MiB bf16 tables, 501 MiB a rank at t = 2), t = 2 + SP, d = 2 with the
    distributed optimizer, 4 micro-batches under `full`: the search's parts within 3% of the whole step compiled for
    the H100 with the tables' compute copy the step holds through its micro-batch loop
    (`search_memory.accumulation_held_copy_bytes`), 9% under it without: the parts' layer program, one micro-batch,
    frees that copy where it makes the tables' gradients."""
    from jaxseq.config import on_platform
    from jaxseq.plan import candidate_parallel
    from jaxseq.planning.search_costs import SearchCosts

    cfg = on_platform(replace(preset("llama3-8b"), layers=4, attention="fused"), "gpu")
    candidate = Candidate(2, 1, 1, 2, 1, "full", True, True, 4)
    layer, state = costs_of(cfg, candidate, SearchCosts(cfg, G.target_devices("h100", 4)))
    memory = search_memory.memory(cfg, candidate, layer, state)
    compiled = aot.step_bytes(G.compile_step(cfg, candidate_parallel(candidate), candidate.remat, candidate.micro_batch,
                                             candidate.microbatches, "h100"))
    assert memory.held_copy_bytes == state.weight_copy_bytes - state.layer_copy_bytes > 0
    assert abs(memory.total_bytes / compiled - 1) <= 0.03, (memory.total_bytes, compiled)
    assert (memory.total_bytes - memory.held_copy_bytes) / compiled - 1 < -0.05, (memory.total_bytes, compiled)


def test_a_searchs_gpu_layer_moves_what_the_whole_steps_layer_loops_move():
    """`plan --search --target`'s layer carries the bytes its loops' memory-bound kernels move (`LayerCost.moved_bytes`,
    read from the 2-layer train step compiled for the H100): per layer, what the whole step at the model's depth moves
    in its layer loops (`hlo_kernels.layer_loop_bytes`), at micro-batches 1 and 2 (a larger one is extrapolated; the
    time model prices those bytes, tests/test_search.py holds it to the H100's measured steps)."""
    from jaxseq.config import on_platform
    from jaxseq.planning.search_costs import SearchCosts

    cfg = replace(preset("tiny"), attention="fused", dtype="bfloat16", layers=4)
    costs = SearchCosts(on_platform(cfg, "gpu"), G.target_devices("h100", 1))
    for b in (1, 2):
        step = G.compile_step(cfg, ParallelConfig(), "lean", b, 1, "h100")
        moved = hlo_kernels.layer_loop_bytes(step.as_text(), cfg.layers)
        assert costs.layer(1, False, "lean", b).moved_bytes == moved > 0


def test_a_searchs_context_layers_compile_with_the_attention_their_strategy_runs():
    """cuDNN's attention does not take the all-gather context strategy's mask (`config.cudnn_compiles`): the search's
    layer at c = 2 compiles with XLA's attention, as `train` runs that layout (it raised inside XLA's partitioner with
    `plan --search --target --attention fused` at any c > 1); at c = 1 with cuDNN's."""
    from jaxseq.config import on_platform
    from jaxseq.planning.measure import Compiler, RowSpec

    cfg = on_platform(replace(preset("tiny"), attention="fused", dtype="bfloat16"), "gpu")
    row = RowSpec("search", "selective", False, 1, None)
    for context, cudnn in ((2, False), (1, True)):
        compiler = Compiler(cfg, 1, G.target_devices("h100", context), context=context, strategy="all-gather")
        grad = compiler.layer_programs(row)[0]  # the layer's loss and gradients, where it raised
        assert (CUDNN_ATTENTION in compiler._compile(*grad).as_text()) == cudnn, context


@pytest.mark.parametrize("dtype,context", [("bfloat16", 1), ("bfloat16", 2), ("float32", 1)])
def test_the_search_prices_as_gemms_the_dots_its_layers_gpu_program_runs(dtype, context):
    """The time model's GEMMs for a candidate's layer (`kernel_time.gemm_kernels` on `costs.run_kernels`: the
    kernels `train` runs it with) are the dots of that layer's program compiled for the H100, per layer, each policy's
    replays included: in bf16 at c = 1 cuDNN's flash kernel runs the attention core (no dot; priced at its own
    rate); at c = 2 all-gather and in float32 XLA's kernel runs it as two dots, and QKᵀ again in the backward of
    every policy, `none`'s too, but `dots`, which keeps every dot's output (the search priced that core as cuDNN's
    flash kernel: half its FLOPs, no softmax through HBM, no replay)."""
    from jaxseq.config import on_platform
    from jaxseq.planning import kernel_time as K
    from jaxseq.planning.measure import MEASURE_LAYERS, Compiler

    cfg = on_platform(replace(preset("tiny"), attention="fused", dtype=dtype), "gpu")
    compiler = Compiler(cfg, 1, G.target_devices("h100", context), context=context, strategy="all-gather")
    dots = lambda *key: hlo_flops.program_dot_flops(compiler._compile("grad", *key).as_text())
    for remat in ("none", "full", "dots"):
        candidate = Candidate(1, 1, 1, 1, 1, remat, False, False, 1, context, "all-gather")
        priced = run_kernels(cfg, candidate)
        assert K.flash(priced) == (dtype == "bfloat16" and context == 1)
        per_layer = (dots(MEASURE_LAYERS, remat, 1, False) - dots(0, "none", 1, False)) / MEASURE_LAYERS
        assert per_layer == pytest.approx(sum(g.flops for g in K.gemm_kernels(priced, 1, 1, remat)) / context), remat


def test_the_largest_micro_batch_that_fits_is_read_from_the_gpus_programs():
    """experiments/gpu.py's `largest_micro_batch`: doubling the micro-batch while the step compiled for the H100 fits
    the device's limit; a device with no target description gets none."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", MEASURED.parents[1] / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    cfg = replace(preset("tiny"), attention="fused")
    planned = {b: G.step_bytes(cfg, ParallelConfig(), "full", b, 1, "h100") for b in (2, 4)}
    limit = (planned[2] + planned[4]) // 2
    assert planned[2] < limit < planned[4]
    assert gpu.largest_micro_batch(cfg, 1, False, "full", limit, "NVIDIA H100 80GB HBM3", 2) == (2, planned[2])
    assert gpu.largest_micro_batch(cfg, 1, False, "full", limit, "NVIDIA L4", 2) is None


def test_an_unknown_target_or_a_missing_plugin_is_one_line(monkeypatch):
    with pytest.raises(ConfigError, match=r"^target='v100' is not a known GPU; valid: a100, h100, h200$"):
        G.target_devices("v100", 1)
    from jax.experimental import topologies

    def unavailable(**kwargs):
        raise NotImplementedError("topology not implemented for cuda")

    monkeypatch.setattr(topologies, "get_topology_desc", unavailable)
    with pytest.raises(ConfigError, match=r"target=h100: .* pip install -r requirements-gpu-target.txt$"):
        G.target_devices("h100", 8)


def test_unrolled_layers_keep_each_policy_and_drop_the_scans_stacks():
    """`layer_loop="unrolled"` compiled for the H100: every policy replays the matmuls it does under the scan (the
    same dot FLOPs; explicit attention, where `selective` replays QKᵀ) and holds less than it, in the same order
    (none > selective > full). For gpt3-1.3b as the H100 ran it (fused attention, micro-batch 4), its memory-bound
    kernels move fewer bytes by what the search's time model prices the scan's stacks at
    (`kernel_time.scan_stack_bytes`: 5 passes over the stored bytes, 3 copies of each layer's weights per
    micro-batch), within 20% (at 6 of its 24 layers; all 24 measured on the H100, 13.9% and 4.4% faster:
    experiments/results/gpu_h100_2026-11-27/). At a toy shape, where the weights
    outweigh the activations, the weights' gradient joined by one concatenate (`model.unstack`) is most of it."""
    from jaxseq.models.model import num_params
    from jaxseq.planning import kernel_time as K

    cfg = ModelConfig(vocab_size=1024, seq_len=512, hidden=256, heads=4, layers=4, dtype="bfloat16", dropout=0.0)
    compiled = lambda cfg, loop, remat: G.compile_step(replace(cfg, layer_loop=loop), ParallelConfig(), remat, 4, 1,
                                                       "h100")
    peaks = {}
    for remat in ("none", "selective", "full"):
        scan, unrolled = (compiled(cfg, loop, remat) for loop in ("scan", "unrolled"))
        dots = [hlo_flops.program_dot_flops(s.as_text()) for s in (scan, unrolled)]
        assert dots[0] == dots[1] and aot.step_bytes(unrolled) < aot.step_bytes(scan)
        peaks[remat] = aot.step_bytes(unrolled)
    assert peaks["none"] > peaks["selective"] > peaks["full"]
    (model,) = json.loads((MEASURED / "h100_gpt3-1.3b_mb4.json").read_text())["models"].values()
    # the stacks' bytes are per layer: 6 of its 24 hold them
    gpt = replace(ModelConfig(**saved_model_fields(model["config"])), layers=6)
    layer_parameters = (num_params(gpt) - num_params(replace(gpt, layers=0))) / gpt.layers
    for remat in ("none", "full"):
        moved = [hlo_kernels.memory_bound_bytes(compiled(gpt, loop, remat).as_text()) for loop in ("scan", "unrolled")]
        stored = G.stored_bytes_per_layer(gpt, ParallelConfig(), remat, 4, "h100")
        stacks = gpt.layers * K.scan_stack_bytes(stored, layer_parameters, 2)
        assert moved[0] - moved[1] == pytest.approx(stacks, rel=0.2), (remat, moved, stacks)


RECORDED = MEASURED.parent / "gpu_2026-11-27_autotune" / "h100"  # experiments/gpu.py's run that recorded its choices
RECORDS_ON_THIS_XLA = tuple(map(int, jax.__version__.split(".")[:2])) >= (0, 11)  # JAX 0.10's cannot read them


@pytest.mark.skipif(not RECORDS_ON_THIS_XLA, reason="JAX 0.10's XLA cannot read the files JAX 0.11's XLA:GPU writes "
                                                   "(test_recorded_choices_of_another_step_are_refused_in_one_line)")
def test_with_the_h100s_recorded_gemm_choices_the_step_is_its_measured_peak():
    """Unrolled layers under `full` at micro-batch 4, where the device's autotuner gave 14 GEMMs to cuBLAS and 1 to
    Triton: the all-Triton program is 3.3% under the H100's peak and the all-cuBLAS one 5.9-9.2% over it (so
    `plan --target`, the larger, missed by that much). A plan's row compiled here with the choices that run recorded
    (`plan.recorded_totals`: `planning.autotune`, relabelled for this CUDA build, in a process of its own), on the
    JAX the H100 ran (0.11.2, requirements-gpu-device.txt), is the measured peak within 16 KB: within 4 KB of the
    program the H100 ran, and 8,324 bytes under it since the bias gradient sums its rounded input (the optimization
    barrier in `ops.add_bias`, which no GPU has run yet). Another XLA's fusions
    differ: on JAX 0.12, 3 of the step's GEMMs find no recorded choice, and the file is refused in one line rather
    than passed off as the device's choices (experiments/results/autotune_replay_jax*.md)."""
    from jaxseq.planning import autotune
    from jaxseq.planning.measure import RowSpec
    from jaxseq.planning.plan import recorded_totals

    check = json.loads((RECORDED / "gpu.json").read_text())
    (model,) = check["models"].values()
    run = model["unrolled"]["full"]
    cfg = replace(ModelConfig(**saved_model_fields(model["config"])), layer_loop="unrolled")
    recorded = autotune.RecordedGemms(str(RECORDED / "autotune" / Path(run["autotune_results"]).name))
    assert recorded.cublas_choices == 14
    row = RowSpec("full", "full", False, 1, "full")
    step = dict(data=1, distributed_optimizer=False, pipeline=1, schedule="1f1b", virtual_stages=1, context=1,
                strategy="all-gather", fsdp=1)
    found = lambda: recorded_totals(cfg, [row], model["micro_batch"], 1, "h100", step, recorded)
    if jax.__version__ == check["jax_version"]:
        assert found()[row] == pytest.approx(run["peak_bytes_in_use"], abs=16384)
    else:
        with pytest.raises(ConfigError, match="holds the choices of none of these steps"):
            found()


def test_recorded_choices_of_another_step_are_refused_in_one_line(devices, tmp_path):
    """`plan --target --autotune-results` with a file recorded from another step (gpt3-1.3b's, for tiny): no row's
    GEMMs are in it, which the plan says in one line rather than passing XLA's defaults off as the device's
    choices. On
    JAX 0.10 the file cannot be read at all: one line too. A file that is not autotune results is refused before
    anything compiles."""
    from jaxseq.planning import autotune
    from jaxseq.planning.plan import plan

    (model,) = json.loads((RECORDED / "gpu.json").read_text())["models"].values()
    recorded = autotune.RecordedGemms(
        str(RECORDED / "autotune" / Path(model["policies"]["full"]["autotune_results"]).name))
    cfg = replace(preset("tiny"), attention="fused")
    message = ("holds the choices of none of these steps" if RECORDS_ON_THIS_XLA else
               rf"this JAX's XLA \({jax.__version__}\) cannot read it")
    with pytest.raises(ConfigError, match=message) as e:
        plan(cfg, 1, 2, devices, policies=("full",), target="h100", recorded=recorded)
    assert "\n" not in str(e.value)
    (tmp_path / "notes.txt").write_text("not autotune results\n")
    for path, why in ((tmp_path / "missing.textproto", "cannot be read"),
                      (tmp_path / "notes.txt", "holds no autotune")):
        with pytest.raises(ConfigError, match=f"^--autotune-results {path}: {why}"):
            autotune.RecordedGemms(str(path))


@pytest.mark.slow
def test_block_recompute_compiled_for_the_h100_is_the_plans_and_the_searchs_composition():
    """Megatron's block recompute (`--remat full:N`) compiled for the H100 (gpt3-1.3b's width, 6 layers, micro-batch
    4, cuDNN attention): the whole step's peak (Triton's and cuBLAS's programs, the larger) against the plan's row
    composed from its `none` and `full` rows (`recommend.block_row`) and the search's memory composed from its two
    layers (`search_memory.block_memory`, `plan --search --target --block-recompute`). Measured 2026-11-28, N = 1…5:
    the plan 0.0%, −0.7%, −0.3%, −0.2%, −1.3%; the search −1.0% to −2.6% (its plain `none` −1.0%, `full` −2.3%); here
    N = 3 of the 6 layers, both segments as large (each N is a whole step compiled twice, Triton's and cuBLAS's).
    No copy of the weights, as XLA:CPU's float32 step makes (tests/test_block_recompute.py): the bf16 cast
    writes the two segments' parts. Since GPT's Q, K and V are three weights the plan's composition is 2.1% under:
    XLA's cuBLAS program of `full:3` holds 180 MiB more than with the fused kernel (9,953 MiB against 9,773; its
    `none` and `full` programs, which the compositions read, are within 63 MiB of the fused ones): 2.5% here for the
    plan, 4% for the search (3.8% under; 2.6% at most with the fused kernel)."""
    from jaxseq.config import on_platform
    from jaxseq.planning import plan as P
    from jaxseq.planning.recommend import block_row
    from jaxseq.planning.search_costs import SearchCosts

    cfg = replace(preset("gpt3-1.3b"), layers=6, dtype="bfloat16", attention="fused")
    p = P.plan(cfg, 1, 4, jax.devices(), "gpt3-1.3b", policies=["full"], target="h100")
    searched = on_platform(cfg, "gpu")
    costs = SearchCosts(searched, G.target_devices("h100", 2))
    plain = {remat: Candidate(1, 1, 1, 1, 4, remat, False, False, 1) for remat in ("none", "full")}
    layers = {remat: costs_of(searched, c, costs) for remat, c in plain.items()}
    memory = {remat: search_memory.memory(searched, plain[remat], *layers[remat]) for remat in plain}
    parallel = G.step_parallel(tensor=1, sequence_parallel=False)
    n = 3
    compiled = G.step_bytes(cfg, parallel, f"full:{n}", 4, 1, "h100")
    composed = block_row(p, p.row("full"), p.row("none"), n).total_bytes_per_device
    parts = search_memory.block_memory(memory["none"], memory["full"], layers["none"][0].stored_bytes,
                                       n, 6).total_bytes
    assert abs(composed / compiled - 1) <= 0.025, (n, composed, compiled)
    assert abs(parts / compiled - 1) <= 0.04, (n, parts, compiled)


# FP8 GEMMs (`--fp8`, models/fp8.py): the layers' weight matmuls of GPT (Q, K, V, attention output, MLP in and out) and
# Llama (Q, K/V, attention output, MLP in and out), each a forward GEMM and two backward ones, and those the policy
# replays in backward (`full`: all but the last MLP matmul); the LM head's three GEMMs stay bf16.
LAYER_MATMULS = {"gpt": ("bsh,had->bsad",) * 3 + ("bsad,adh->bsh", "bsh,hf->bsf", "bsf,fh->bsh"),
                 "llama": ("bsh,had->bsad", "bsh,hckd->bsckd", "bsad,adh->bsh", "bsh,hcf->bscf", "bsf,fh->bsh")}


def _gemms_by_matmul(text: str) -> dict[str, int]:
    """Layer matmul spec → the cuBLAS GEMM calls of the program whose op names come from it, FP8 or not, per step."""
    comps, runs = hlo.parse_hlo(text), hlo_loops_runs(text)
    out = {}
    for comp, instrs in comps.items():
        for ins in instrs:
            target = re.search(r'custom_call_target="([^"]*)"', ins.rest)
            if ins.opcode == "custom-call" and target and target.group(1).startswith(hlo.CUBLAS):
                spec = next((s for specs in LAYER_MATMULS.values() for s in specs if f"/{s}/" in hlo.op_name(ins.rest)),
                            None)
                key = (spec, target.group(1).endswith("$f8"))
                out[key] = out.get(key, 0) + runs.get(comp, 0)
    return out


def hlo_loops_runs(text: str) -> dict[str, int]:
    from jaxseq.planning import hlo_loops

    return hlo_loops.runs_per_call(text)


@pytest.fixture(scope="module")
def shared_steps():
    """`gpu_target.compile_step` compiling each distinct step once in this module: the FP8 tests below and the plan
    they call share their H100 programs (the tiny FP8 step and the bf16 cuBLAS one)."""
    compiled, compile_step = {}, G.compile_step
    signature = inspect.signature(compile_step)

    def once(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        key = repr(bound.arguments)  # frozen configs and strings, the same text for the same step
        if key not in compiled:
            compiled[key] = compile_step(*args, **kwargs)
        return compiled[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(G, "compile_step", once)
        yield


# XLA's dot merger joins the projections of one input (GPT's Q, K and V; Llama's Q and K/V) into one GEMM in bf16,
# forward, in their weight gradients and in `full`'s replayed forward: GEMMs fewer each time; `fp8.GPU_OPTIONS` turns
# it off, so an FP8 layer keeps all its GEMMs
MERGED_IN_BF16 = {"gpt": 2, "llama": 1}


@pytest.mark.slow  # two tiny steps compiled for an H100
@pytest.mark.xdist_group("shared_steps")  # `--dist loadgroup` (.ci/run): on the worker that compiled them
@pytest.mark.parametrize("name,remat", [("tiny", "selective"), ("tiny", "full"),
                                        ("tiny-llama", "lean")])
def test_with_fp8_every_layer_weight_gemm_is_an_fp8_gemm_and_without_none_is(name, remat, shared_steps):
    """The train step compiled for an H100 with --fp8 (its options: Triton's GEMMs off, no dot merging,
    `fp8.GPU_OPTIONS`): every GEMM of every layer weight matmul, forward, input gradient, weight gradient and the
    policy's replays, is cuBLASLt's FP8 GEMM (`__cublas$lt$matmul$f8`), and nothing else is; without --fp8 none is."""
    cfg = replace(preset(name), attention="fused", dropout=0.0)
    matmuls = LAYER_MATMULS[cfg.family]
    replays = len(matmuls) - 1 if remat == "full" else 0  # the forward GEMMs `full` runs again, all but the last
    per_layer = 3 * len(matmuls) + replays
    fp8_text = G.compile_step(replace(cfg, fp8=True), ParallelConfig(), remat, 2, 1, "h100", "cublas").as_text()
    bf16_text = G.compile_step(cfg, ParallelConfig(), remat, 2, 1, "h100", "cublas").as_text()
    fp8, bf16 = hlo_flops.gemm_count(fp8_text), hlo_flops.gemm_count(bf16_text)
    assert (fp8.gemms, fp8.fp8_gemms) == (per_layer * cfg.layers + 3, per_layer * cfg.layers)
    bf16_layer = per_layer - MERGED_IN_BF16[cfg.family] * (3 if remat == "full" else 2)
    assert (bf16.gemms, bf16.fp8_gemms, bf16.fp8_flops) == (bf16_layer * cfg.layers + 3, 0, 0)
    # their FLOPs, from the layer's shapes: each weight GEMM forward, its two gradients and the policy's replays
    shapes = kernel_time.forward_gemms(cfg, 2, 1)
    replayed = ("qkv", "out", "mlp_up") if remat == "full" else ()
    layer_flops = sum(shapes[n].flops * (3 + (n in replayed)) for n in kernel_time.WEIGHT_GEMMS)
    assert fp8.fp8_flops == pytest.approx(layer_flops * cfg.layers, rel=1e-12)
    assert fp8.flops == pytest.approx(bf16.flops, rel=1e-12) and fp8.flops > fp8.fp8_flops  # the LM head's, bf16
    by_matmul = _gemms_by_matmul(fp8_text)
    for spec in matmuls:  # each matmul's forward and both backward GEMMs, in every layer
        assert by_matmul[(spec, True)] >= 3 * cfg.layers and (spec, False) not in by_matmul, (spec, by_matmul)
    assert by_matmul[(None, False)] == 3 and (None, True) not in by_matmul  # the LM head, bf16
    assert not any(fp8 for _, fp8 in _gemms_by_matmul(bf16_text))


@pytest.mark.slow  # a plan: CPU programs, and GPU ones beside the FP8 test's (the layer, the bf16 Triton step)
@pytest.mark.xdist_group("shared_steps")
def test_a_plan_with_fp8_for_a_target_is_its_fp8_step_with_the_copies_named(devices, shared_steps):
    """`plan --target h100 --fp8`: the row's total is the FP8 step compiled for the H100 (the compiled step itself,
    within 0%), with its FP8 GEMMs counted, what FP8 adds to the peak against the same step in bf16, and the FP8
    copies its layers make by kind."""
    from jaxseq.planning.plan import plan

    cfg = replace(preset("tiny"), attention="fused", dropout=0.0, fp8=True)
    row = plan(cfg, 1, 2, devices, policies=("selective",), target="h100").row("selective")
    fp8_peak = G.step_bytes(cfg, ParallelConfig(), "selective", 2, 1, "h100")
    bf16_peak = G.step_bytes(replace(cfg, fp8=False), ParallelConfig(), "selective", 2, 1, "h100")
    assert row.total_bytes_per_device == fp8_peak
    assert (row.fp8_gemms_per_step, row.gemms_per_step) == (36, 39)
    assert row.fp8_extra_bytes_per_device == fp8_peak - bf16_peak
    assert set(row.fp8_copy_bytes_per_layer) >= {"e4m3", "e5m2 transposed"}
