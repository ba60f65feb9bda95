"""Configuration: presets, one-line errors at config time, and the parameter sharding table."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxseq.config import ConfigError, ModelConfig, ParallelConfig, replace, validate
from jaxseq.presets import PRESETS, preset
from jaxseq.mesh import make_mesh
from jaxseq.models import model as M


def test_paper_presets():
    for name, (a, h, L) in {"megatron-22b": (64, 6144, 48), "gpt3-175b": (96, 12288, 96),
                            "mt-nlg-530b": (128, 20480, 105), "megatron-1t": (160, 25600, 128)}.items():
        cfg = preset(name)
        assert (cfg.heads, cfg.hidden, cfg.layers, cfg.seq_len, cfg.vocab_size) == (a, h, L, 2048, 51200)
    assert (preset("gpt3-1.3b").layers, preset("gpt3-1.3b").hidden, preset("gpt3-1.3b").heads) == (24, 2048, 24)


def test_parameter_counts_from_the_tables_equal_the_published_models():
    """models.model.num_params, counted from each family's parameter table, equals what `transformers` reports
    for the published checkpoints (`model.num_parameters()`: GPT-2's tied embedding once, Llama's untied head)."""
    published = {"gpt2-124m": 124_439_808, "llama2-7b": 6_738_415_616, "llama3-8b": 8_030_261_248,
                 "llama3-70b": 70_553_706_496, "mixtral-8x7b": 46_702_792_704, "qwen3-30b-a3b": 30_532_122_624}
    assert {name: M.num_params(preset(name)) for name in published} == published


def test_every_preset_is_valid():
    for name, cfg in PRESETS.items():
        validate(cfg, ParallelConfig(data=1, tensor=1), "selective")


def test_vocab_padding():
    assert preset("gpt2-124m").padded_vocab(1) == 50304
    assert preset("gpt2-124m").padded_vocab(8) == 51200
    assert preset("gpt3-175b").padded_vocab(8) == 51200


BAD = [
    (dict(parallel=ParallelConfig(data=1, tensor=3)), "tensor=3 does not divide heads=8"),
    (dict(model=replace(preset("tiny"), heads=4, hidden=64, mlp_ratio=1), parallel=ParallelConfig(data=1, tensor=4), ),
     None),  # valid: 4 | 4 heads and 4 | 64
    (dict(model=replace(preset("tiny"), mlp_ratio=1, hidden=36, kv_channels=8), parallel=ParallelConfig(data=1,
                                                                                                        tensor=8)),
     "tensor=8 does not divide mlp width=36"),
    (dict(parallel=ParallelConfig(data=2, tensor=2), num_devices=8),
     "data×tensor = 2×2 = 4 does not equal the device count 8"),
    (dict(model=replace(preset("tiny"), seq_len=66), parallel=ParallelConfig(data=1, tensor=4, sequence_parallel=True)),
     "tensor=4 does not divide seq_len=66"),
    (dict(remat="selctive"), "remat='selctive' is not a registered policy"),
    (dict(model=replace(preset("tiny"), attention="flash")), "attention='flash' is not valid; valid: explicit, fused"),
    (dict(parallel=ParallelConfig(data=4, tensor=1), batch_size=6), "data=4 does not divide batch_size=6"),
    (dict(model=replace(preset("tiny"), dtype="fp8")), "dtype='fp8' is not valid"),
    (dict(model=replace(preset("tiny"), dtype="float16")), "dtype='float16' needs loss scaling"),
    (dict(model=replace(preset("tiny"), hidden=60)), "heads=8 does not divide hidden=60"),
    # A pipeline schedule without a pipeline was accepted and ignored (issue 22, item 13).
    (dict(parallel=ParallelConfig(data=1, tensor=1, schedule="interleaved", virtual_stages=2)),
     "schedule='interleaved' with virtual_stages=2 needs a pipeline, and pipe=1"),
    (dict(parallel=ParallelConfig(data=1, tensor=1, virtual_stages=2)),
     "schedule='1f1b' with virtual_stages=2 needs a pipeline, and pipe=1"),
    (dict(parallel=ParallelConfig(data=1, tensor=1, schedule="gpipe")),
     "schedule='gpipe' with virtual_stages=1 needs a pipeline, and pipe=1"),
    (dict(parallel=ParallelConfig(data=1, tensor=1, pipe=2, schedule="interleaved", virtual_stages=1)),
     "schedule=interleaved needs virtual_stages ≥ 2"),
    (dict(parallel=ParallelConfig(data=1, tensor=1, pipe=2, virtual_stages=1)), None),  # valid: 1F1B on 2 stages
]


@pytest.mark.parametrize("kwargs,message", BAD)
def test_bad_configuration_gives_one_clear_line(kwargs, message):
    args = dict(model=preset("tiny"), parallel=ParallelConfig(data=1, tensor=1), remat="selective")
    args.update(kwargs)
    if message is None:
        validate(**args)
        return
    with pytest.raises(ConfigError) as err:
        validate(**args)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_field_and_preset():
    with pytest.raises(ConfigError, match="unknown ModelConfig field 'hiden'"):
        replace(preset("tiny"), hiden=3)
    with pytest.raises(ConfigError, match="unknown preset 'gpt5'; valid: tiny"):
        preset("gpt5")


def test_mesh_device_count_mismatch():
    with pytest.raises(ConfigError, match="does not equal the device count 8"):
        make_mesh(ParallelConfig(data=2, tensor=2))


# The golden table: Megatron's layouts. Column-parallel Q, K and V (heads) and MLP-up (mlp), row-parallel
# projection and MLP-down, vocab-parallel embedding; everything else replicated. Layers are stacked.
GOLDEN = {
    "['embed']['token']": P("tensor", None),
    "['embed']['position']": P(None, None),
    "['final_ln']['bias']": P(None),
    "['final_ln']['scale']": P(None),
    "['layers']['attn']['out']['bias']": P(None, None),
    "['layers']['attn']['out']['kernel']": P(None, "tensor", None, None),
    **{f"['layers']['attn']['{name}']['bias']": P(None, "tensor", None) for name in ("q", "k", "v")},
    **{f"['layers']['attn']['{name}']['kernel']": P(None, None, "tensor", None) for name in ("q", "k", "v")},
    "['layers']['ln1']['bias']": P(None, None),
    "['layers']['ln1']['scale']": P(None, None),
    "['layers']['ln2']['bias']": P(None, None),
    "['layers']['ln2']['scale']": P(None, None),
    "['layers']['mlp']['wi']['bias']": P(None, "tensor"),
    "['layers']['mlp']['wi']['kernel']": P(None, None, "tensor"),
    "['layers']['mlp']['wo']['bias']": P(None, None),
    "['layers']['mlp']['wo']['kernel']": P(None, "tensor", None),
}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_param_specs_golden(sequence_parallel):
    specs = M.param_specs(ModelConfig(), ParallelConfig(data=2, tensor=4, sequence_parallel=sequence_parallel))
    flat = {jax.tree_util.keystr(path): spec for path, spec in
            jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, P))}
    assert flat == GOLDEN


def test_model_config_is_frozen():
    with pytest.raises(Exception):
        ModelConfig().hidden = 3


def test_on_platform_picks_the_kernels_once():
    """The commands' edge: XLA:CPU's bf16 matmul form on CPU, the portable einsum elsewhere; cuDNN's fused
    attention on GPUs in bf16 (jax.nn.dot_product_attention runs XLA's, scores materialised, unless told)."""
    from jaxseq.config import on_platform

    bf16, f32 = replace(preset("tiny"), attention="fused"), replace(preset("tiny"), attention="fused", dtype="float32")
    assert (on_platform(bf16, "cpu").matmul, on_platform(bf16, "cpu").fused_kernel) == ("cpu-bf16", "xla")
    assert (on_platform(bf16, "gpu").matmul, on_platform(bf16, "gpu").fused_kernel) == ("einsum", "cudnn")
    assert on_platform(f32, "gpu").fused_kernel == "xla"  # cuDNN's flash attention takes 16-bit inputs


def test_fused_attention_asks_for_the_configured_kernel(monkeypatch):
    import jax.numpy as jnp

    from jaxseq.models import ops
    from jaxseq.sharding import Sharder

    """cuDNN's through jaxseq's VJP (models/cudnn_attention.py, around cuDNN's kernel), XLA's directly."""
    from jaxseq.models import cudnn_attention

    asked = []
    monkeypatch.setattr(ops.jax.nn, "dot_product_attention",
                        lambda *a, **kw: asked.append(kw["implementation"]) or a[0])
    monkeypatch.setattr(ops, "cudnn_attention", lambda q, k, v, shard, tag: asked.append("jaxseq's VJP") or q)
    q = jnp.zeros((1, 4, 2, 8))
    for kernel in ("cudnn", "xla"):
        ops.attention(q, q, q, replace(preset("tiny"), attention="fused", fused_kernel=kernel), None, Sharder(None))
    assert asked == ["jaxseq's VJP", "xla"]
    assert cudnn_attention.KERNEL.keywords == {"is_causal": True, "implementation": "cudnn"}


class GpuLike:
    """A CPU device reported as a GPU: what `train.resolve` reads of the devices to choose kernels is their platform."""

    def __init__(self, device):
        self.device = device

    def __getattr__(self, name):
        return "gpu" if name == "platform" else getattr(self.device, name)


def test_a_gpu_run_unrolls_its_layers_and_with_fused_attention_keeps_everything_unless_asked_otherwise(monkeypatch,
                                                                                                      tmp_path):
    """On GPUs without a pipeline the layers run unrolled (no scan stacks; a pipeline's stages scan), and with fused
    attention the policy is `none` there (unrolled `none` is the fastest step an H100 measured; `selective` = `none`
    under cuDNN) and `lean` scanned (`lean` below both in memory and time under the scan); the paper's `selective`
    and the scan elsewhere; a policy or a loop asked for (flag, YAML, key=value) is kept."""
    from jaxseq import train
    from jaxseq.config import default_layer_loop, default_remat

    assert default_remat("gpu", "fused", "unrolled") == "none" and default_remat("gpu", "fused", "scan") == "lean"
    assert default_remat("gpu", "explicit", "unrolled") == default_remat("cpu", "fused") == "selective"
    assert default_layer_loop("gpu", ParallelConfig(data=8)) == "unrolled"
    assert default_layer_loop("gpu", ParallelConfig(pipe=2)) == default_layer_loop("cpu", ParallelConfig()) == "scan"

    monkeypatch.setattr(train, "available_devices", lambda: [GpuLike(d) for d in jax.devices()])
    base = ["--preset", "tiny", "--attention", "fused", "--steps", "1", "--run-dir", str(tmp_path / "run"),
            "--mesh", "tensor=8"]
    resolved = lambda *argv: train.resolve(train.build_parser().parse_args([*argv]))[0]
    run = resolved(*base)
    assert (run.train.remat, run.model.layer_loop, run.model.fused_kernel) == ("none", "unrolled", "cudnn")
    run = resolved(*base, "--remat", "selective")
    assert (run.train.remat, run.model.layer_loop) == ("selective", "unrolled")
    run = resolved(*base, "layer_loop=scan")
    assert (run.train.remat, run.model.layer_loop) == ("lean", "scan")
    run = resolved(*base[:-1], "pipe=2,tensor=4", "--micro-batch-size", "8")
    assert (run.train.remat, run.model.layer_loop) == ("lean", "scan")
    run = resolved(*base[:2], *base[4:])  # explicit attention
    assert (run.train.remat, run.model.layer_loop) == ("selective", "unrolled")


def test_cudnn_attention_only_where_it_compiles(monkeypatch, tmp_path, capsys):
    """cuDNN's attention (models/cudnn_attention.py) compiles at the top level and nested inside jaxseq's data,
    FSDP and pipeline regions, not for the all-gather context strategy's mask (tests/test_gpu_target.py compiles
    them for an H100): that layout takes XLA's, and `train` says so in one line; the ring keeps cuDNN's."""
    from jaxseq import train
    from jaxseq.config import cudnn_compiles, on_platform

    bf16 = replace(preset("tiny"), attention="fused", dtype="bfloat16")
    for parallel, cudnn in ((ParallelConfig(tensor=8, sequence_parallel=True), True), (ParallelConfig(data=2), True),
                            (ParallelConfig(pipe=2), True), (ParallelConfig(fsdp=2), True),
                            (ParallelConfig(context=2), False),
                            (ParallelConfig(context=2, context_strategy="ring"), True)):
        assert cudnn_compiles(parallel) == cudnn
        assert on_platform(bf16, "gpu", parallel).fused_kernel == ("cudnn" if cudnn else "xla"), parallel

    monkeypatch.setattr(train, "available_devices", lambda: [GpuLike(d) for d in jax.devices()])
    argv = ["--preset", "tiny", "--attention", "fused", "--steps", "1", "--run-dir", str(tmp_path / "run")]
    run, _ = train.resolve(train.build_parser().parse_args(argv))  # a GPU's default mesh: data = every device
    assert run.parallel.data == 8 and run.model.fused_kernel == "cudnn" and capsys.readouterr().out == ""
    run, _ = train.resolve(train.build_parser().parse_args(argv + ["--mesh", "data=4,context=2"]))
    assert run.parallel.context == 2 and run.model.fused_kernel == "xla"
    assert capsys.readouterr().out.startswith("attention: XLA's fused attention (scores materialised), not cuDNN's")
