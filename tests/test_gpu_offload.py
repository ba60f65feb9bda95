"""Host offload in the program compiled for an H100 on this machine (JAX's CUDA plugin, as tests/test_gpu_target.py):
the bytes XLA:GPU holds in host memory equal the formula (`planning.host_tier`: the offloaded tensors' bytes × the
layers that hold them), every offloaded tensor is copied out to the host and back (`planning.hlo_host`: an offload
XLA dropped has neither, and fails), the device's peak falls by what went to the host, and the optimizer state
offloaded is the master weights and moments, 12 bytes a parameter over its shards."""

import dataclasses

import jax
import pytest

from jaxseq import offload as O
from jaxseq.config import ParallelConfig, on_platform, replace
from jaxseq.presets import preset
from jaxseq.models import model as M
from jaxseq.planning import gpu_target as G
from jaxseq.planning import hlo_host, host_tier
from jaxseq.sharding import Sharder
from jaxseq.training import aot

pytest.importorskip("jax_cuda12_plugin", reason="the CUDA plugin: pip install -r requirements-gpu-target.txt")

# A GPT small enough to compile in seconds, with dropout (its masks are stored tensors too): 4 layers, b = 2
SMALL = replace(preset("tiny"), layers=4, seq_len=256, hidden=256, heads=4)
B = 2


pytestmark = pytest.mark.usefixtures("no_persistent_cache")  # conftest.py: target programs are not loaded back


def _names(cfg, remat: str, text: str = "all") -> tuple[str, ...]:
    return O.resolve(text, remat, M.tagged_names(on_platform(cfg, "gpu")))


def test_a_cudnn_layers_names_are_those_its_backward_keeps():
    """`models.model.tagged_names` of a layer under cuDNN's attention (composed, since cuDNN traces only where it is)
    equals the names in that layer's forward for its backward, traced here with JAX's CUDA plugin (`jax.vjp`: the
    context and statistics are tagged inside cuDNN's VJP's forward rule, which a plain trace does not enter)."""
    cfg = on_platform(replace(SMALL, attention="fused", dropout=0.0), "gpu")
    assert cfg.fused_kernel == "cudnn"
    shapes, cast = M.param_shapes(cfg, 1)["layers"], M.cast_mask(cfg)["layers"]
    p = jax.tree.map(lambda shape, c: jax.ShapeDtypeStruct(shape[1:], cfg.dtype if c else "float32"), shapes, cast,
                     is_leaf=lambda x: isinstance(x, tuple))
    x = jax.ShapeDtypeStruct((1, cfg.seq_len, cfg.hidden), cfg.dtype)
    forward = jax.make_jaxpr(lambda x, p: jax.vjp(lambda x, p: M.block(x, p, None, cfg, Sharder(None)), x, p)[0])
    assert M.tagged_names(cfg) == M._names_in(forward(x, p).jaxpr) >= {"context", "attn_softmax_stats"}


def _every_host_array_moves_out_and_back(text: str, arrays: list) -> None:
    """Each host buffer of `arrays` is written from the device and read back to it as many times as there are
    buffers of its shape: one copy out and one back each."""
    moved = hlo_host.host_arrays_moved(text)
    for array in set(arrays):
        count = arrays.count(array)
        assert moved.get(array) == (count, count), (array, moved.get(array), count)


def test_a_scanned_layers_offload_is_the_formulas_bytes_each_copied_out_and_back():
    """`all` of `selective`: XLA:GPU's host temporaries are the formula's bytes per layer × L, its forward loop's
    stacks in host memory are as many as the stored tensors' leaves (LayerNorm's mean and 1/std of two norms: four),
    and each is written from the device in the forward loop and read back in the backward loop."""
    names = _names(SMALL, "selective")
    compiled = G.compile_step(SMALL, ParallelConfig(), "selective", B, 1, "h100", offload=names)
    text = compiled.as_text()
    per_layer = host_tier.bytes_per_layer(on_platform(SMALL, "gpu"), "selective", names, B, 1, False)
    assert compiled.memory_analysis().host_temp_size_in_bytes == per_layer * SMALL.layers > 0
    assert hlo_host.host_bytes_per_layer(text, SMALL.layers) == per_layer
    stacks = hlo_host.host_stacks(text, SMALL.layers)
    assert len(stacks) == len(names) + 3  # norm_stats: four arrays
    _every_host_array_moves_out_and_back(text, stacks)


@pytest.mark.slow
def test_block_recompute_offloads_each_segments_own():
    """full:1+selective with `all`: the `full` layer offloads its input, the three `selective` layers everything they
    store (the formula, averaged over the chunk, × L; a one-layer segment is no loop, and XLA's host temporaries
    count its copy as an unrolled layer's: not at all here), each copied out and back."""
    names = _names(SMALL, "full:1+selective")
    compiled = G.compile_step(SMALL, ParallelConfig(), "full:1+selective", B, 1, "h100", offload=names)
    gpu, host = on_platform(SMALL, "gpu"), compiled.memory_analysis().host_temp_size_in_bytes
    selective = host_tier.bytes_per_layer(gpu, "selective", names, B, 1, False)
    block = host_tier.bytes_per_layer(gpu, "full:1+selective", names, B, 1, False, chunk_layers=SMALL.layers)
    assert 3 * selective <= host <= block * SMALL.layers
    moved = hlo_host.host_arrays_moved(compiled.as_text())
    assert len(moved) == 6 and all(out == back > 0 for out, back in moved.values())  # five shapes of selective's, one


@pytest.mark.slow
def test_an_offloaded_name_xla_dropped_would_fail():
    """One name at a time: its tensor alone is in host memory (the formula's bytes), copied out and back; nothing
    else is. What `test_a_scanned_layers_offload…` reads for all of them at once, per name."""
    for name in ("context", "mlpwi"):
        compiled = G.compile_step(SMALL, ParallelConfig(), "lean", B, 1, "h100", offload=(name,))
        text = compiled.as_text()
        expected = host_tier.name_bytes(on_platform(SMALL, "gpu"), name, B, 1, False)
        assert hlo_host.host_bytes_per_layer(text, SMALL.layers) == expected
        stacks = hlo_host.host_stacks(text, SMALL.layers)
        assert len(stacks) == 1
        _every_host_array_moves_out_and_back(text, stacks)


@pytest.mark.slow
def test_unrolled_layers_copy_each_offloaded_tensor_out_and_back():
    """Without a scan there are no stacks: each layer's tensor is its own host buffer, copied out and back once per
    layer (L × the tensors each way). XLA's buffer assignment holds less than L layers' worth in host memory at once
    (the last layer's backward reads its tensors as soon as they are written: 3.1 of 4 layers here), so the formula is
    the bound, one layer the slack."""
    cfg = replace(SMALL, layer_loop="unrolled")
    names = _names(cfg, "lean")
    compiled = G.compile_step(cfg, ParallelConfig(), "lean", B, 1, "h100", offload=names)
    per_layer = host_tier.bytes_per_layer(on_platform(cfg, "gpu"), "lean", names, B, 1, False)
    assert (cfg.layers - 1) * per_layer <= compiled.memory_analysis().host_temp_size_in_bytes <= cfg.layers * per_layer
    moved = hlo_host.host_arrays_moved(compiled.as_text())
    assert sum(out for out, _ in moved.values()) == sum(back for _, back in moved.values()) == len(names) * cfg.layers


@pytest.mark.slow
def test_the_device_peak_falls_by_what_went_to_the_host():
    """gpt3-1.3b, micro-batch 4, `lean` with all it stores offloaded: the whole step's host temporaries are the
    formula's 336 MiB a layer × 24, and the device's peak falls by them within 3% of the peak (the tolerance the plan
    holds XLA:GPU's programs to): what XLA keeps on the device to copy a layer's tensors back is one layer's, not L."""
    cfg = replace(preset("gpt3-1.3b"), attention="fused", dropout=0.0)
    names = _names(cfg, "lean")
    base, offloaded = (G.compile_step(cfg, ParallelConfig(), "lean", 4, 1, "h100", offload=n) for n in ((), names))
    host = offloaded.memory_analysis().host_temp_size_in_bytes
    per_layer = host_tier.bytes_per_layer(on_platform(cfg, "gpu"), "lean", names, 4, 1, False)
    assert host == per_layer * cfg.layers
    fall = aot.step_bytes(base) - aot.step_bytes(offloaded)
    assert abs(fall - host) < 0.03 * aot.step_bytes(base), (fall, host, aot.step_bytes(base))


@pytest.mark.slow
def test_a_pipeline_stages_stash_waits_in_host_memory():
    """1F1B over 2 stages, 4 micro-batches: the offloaded tensors of every stash slot (2) and of its trash slot, and
    the chunk's own in its forward, are in host memory: (2 + 1 + 1) slots × k = 2 layers × the formula's bytes a layer;
    each chunk's offloaded tensor is written from the device, each stash buffer read back to it, and no computation
    runs on the host's thread. The chunk's forward leaves its offloaded residuals in host memory and the stash slot is
    written from there by a GPU loop fusion reading and writing host memory (XLA leaves it marked
    `_xla_compute_type="host"`): each residual crosses PCIe twice more than a scanned layer's, which the plan's PCIe
    bytes do not count (docs/planning.md) and a GPU has to time."""
    names = _names(SMALL, "selective")
    parallel = ParallelConfig(pipe=2)
    compiled = G.compile_step(SMALL, parallel, "selective", B, 4, "h100", offload=names)
    per_layer = host_tier.bytes_per_layer(on_platform(SMALL, "gpu"), "selective", names, B, 1, False)
    assert compiled.memory_analysis().host_temp_size_in_bytes == (2 + 1 + 1) * 2 * per_layer
    text = compiled.as_text()
    assert 'execution_thread="host"' not in text
    moved = hlo_host.host_arrays_moved(text)
    written = {array: out for array, (out, _) in moved.items() if array[1][0] != 3}  # [b, …]: the chunk's own
    stashes = {array: back for array, (_, back) in moved.items() if array[1][0] == 3}  # [2 + 1 slots, b, …]
    assert len(written) == len(stashes) == 5 and all(written.values()) and all(stashes.values())


@pytest.mark.parametrize("data", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_the_offloaded_optimizer_state_is_the_masters_and_moments(data):
    """--offload-optimizer (with the distributed optimizer over d ranks): the program's host arguments are the
    float32 master weights and both moments, 12 bytes a parameter / d, and Adam's two step counts (4 bytes each);
    its device arguments are the batch and key alone, and its outputs alias the host's."""
    parallel = ParallelConfig(data=data, distributed_optimizer=data > 1, offload_optimizer=True)
    compiled = G.compile_step(SMALL, parallel, "selective", B, 1, "h100")
    m = compiled.memory_analysis()
    assert m.host_argument_size_in_bytes == 12 * M.num_params(SMALL) // data + 8
    assert m.host_alias_size_in_bytes == m.host_argument_size_in_bytes
    assert m.argument_size_in_bytes < 2**14  # the batch (2 × 256 int32 tokens, twice), the key, the step count


@pytest.mark.slow
def test_a_target_plans_offloaded_row_is_the_gpu_programs_own():
    """`plan --target h100 --offload all`: a row's device total and host bytes are its whole step compiled for the
    H100 with the offload (`plan.offloaded_on_target`, `gpu_target.step_memory`): the host bytes the formula's × L,
    the device total below the same step's without, each labelled as the program's."""
    from jaxseq.planning import measure
    from jaxseq.planning import plan as P

    names = _names(SMALL, "selective")
    c = measure.RowSpec("selective", "selective", False, 1, None)
    zero = {f.name: 0 for f in dataclasses.fields(P.Row) if f.name.endswith(("_per_device", "_per_layer"))}
    row = P.Row(**{**zero, "formula_bytes_per_layer": None}, config=c.name, remat=c.remat, sequence_parallel=False,
                tensor=1, ratio=None, recompute_overhead_pct=0, collectives={}, offload=names)
    step = dict(data=1, distributed_optimizer=False, pipeline=1, schedule="1f1b", virtual_stages=1, context=1,
                strategy="all-gather", fsdp=1, offload_optimizer=False)
    out = P.offloaded_on_target(SMALL, row, c, B, 1, "h100", step, tagged=frozenset(), text="all")
    per_layer = host_tier.bytes_per_layer(on_platform(SMALL, "gpu"), "selective", names, B, 1, False)
    assert out.host_bytes_per_device == per_layer * SMALL.layers
    assert out.total_bytes_per_device < G.step_bytes(SMALL, ParallelConfig(), "selective", B, 1, "h100")
    assert out.memory_source.endswith("; host bytes: the same program's")
