"""GPT-2 interop: a small random GPT-2 built with `transformers` (nothing downloaded) → jaxseq logits
equal the reference on 1 device and on data=2 × tensor=4 with SP; from-hf → to-hf is exact.

transformers is the only outside reference: without torch/transformers these tests fail (an import
error), they are never skipped. The model has a vocabulary that needs padding (300) and a LayerNorm
epsilon other than the default (1e-3: at GPT-2's initial activation variance, about 1e-3, a converter
that dropped it would change every logit)."""

import json
import os

import jax
import numpy as np
import pytest

try:
    import torch
    import transformers
except ImportError as e:  # the outside reference: fail, never skip
    raise ImportError(f"{e}; the comparisons with transformers need `pip install -r requirements-test.txt`") from e
from safetensors.numpy import load_file  # noqa: E402

from jaxseq.config import ParallelConfig  # noqa: E402
from jaxseq import convert  # noqa: E402
from jaxseq.training import conversion  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402

VOCAB, POSITIONS = 300, 32  # 300: not a multiple of 128, so vocabulary padding is exercised
LN_EPS = 1e-3  # not GPT-2's (and jaxseq's) default 1e-5


def gpt2_config(**changes):
    kw = dict(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=64, n_layer=2, n_head=4, layer_norm_epsilon=LN_EPS,
              bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2Config(**{**kw, **changes})


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A random GPT-2 saved as the HF format, non-trivial LayerNorm parameters and biases included."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(gpt2_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("hf") / "gpt2"
    model.save_pretrained(path, safe_serialization=True)
    return model, str(path)


@pytest.fixture(scope="module")
def converted(hf_model, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("conv") / "gpt2-jaxseq")
    assert convert.main(["from-hf", hf_model[1], out]) == 0
    return out


def reference_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 16)).astype(np.int32)


@pytest.mark.parametrize("mesh_shape", [(1, 1, False), (2, 4, True)], ids=["1dev", "data2-tensor4-sp"])
def test_logits_match_transformers(hf_model, converted, devices, mesh_shape):
    data, tensor, sp = mesh_shape
    ref = reference_logits(hf_model[0], TOKENS)
    cfg, params = conversion.load(converted)
    assert (cfg.vocab_size, cfg.seq_len, cfg.dropout, cfg.dtype, cfg.ln_eps) == (VOCAB, POSITIONS, 0.0, "float32",
                                                                                 LN_EPS)
    # Read onto every device (8), tensor-parallel as far as the 4 heads split: the vocabulary padded for tensor=4.
    assert params["embed"]["token"].shape[0] == cfg.padded_vocab(4) == 512
    assert params["embed"]["token"].sharding.spec == jax.sharding.PartitionSpec("tensor", None)
    mesh = make_mesh(ParallelConfig(data=data, tensor=tensor, sequence_parallel=sp), devices[: data * tensor])
    out = conversion.logits(params, TOKENS, cfg, mesh=None if data * tensor == 1 else mesh, sequence_parallel=sp)
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=0)


def test_load_hf_api(hf_model):
    cfg, params = conversion.load_hf(hf_model[1])
    np.testing.assert_allclose(conversion.logits(params, TOKENS[:1], cfg), reference_logits(hf_model[0], TOKENS[:1]),
                               atol=1e-4, rtol=0)


def test_round_trip_is_exact(hf_model, converted, tmp_path):
    back = str(tmp_path / "back")
    assert convert.main(["to-hf", converted, back]) == 0
    src, dst = (load_file(os.path.join(hf_model[1], "model.safetensors")),
                load_file(os.path.join(back, "model.safetensors")))
    assert list(dst) == list(src)
    for name, t in src.items():
        assert dst[name].dtype == t.dtype and dst[name].shape == t.shape, name
        assert np.array_equal(dst[name], t), name
    assert open(os.path.join(back, "config.json")).read() == open(os.path.join(hf_model[1], "config.json")).read()
    assert ({n: file_mode(os.path.join(back, n)) for n in os.listdir(back)}
            == {n: umask_mode() for n in os.listdir(back)})
    # The step directory form reads the same checkpoint.
    assert convert.main(["to-hf", os.path.join(converted, "checkpoints", "0"), str(tmp_path / "step0")]) == 0


def test_to_hf_loads_in_transformers(hf_model, converted, tmp_path):
    """Without the original config (as for a run trained in jaxseq) to-hf writes one of its own."""
    cfg, params = conversion.load(converted)
    run = tmp_path / "run"
    os.makedirs(run)
    for name in ("config.json", "checkpoints"):
        os.symlink(os.path.join(converted, name), run / name)
    assert convert.main(["to-hf", str(run), str(tmp_path / "out")]) == 0
    model, info = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    np.testing.assert_allclose(reference_logits(model.eval(), TOKENS), reference_logits(hf_model[0], TOKENS), atol=1e-6)


def test_init_state_on_a_tensor_sp_mesh(converted, devices):
    """What `train --init-from` uses: the saved weights placed on data=2 × tensor=4 + SP, padded for it."""
    from jaxseq.training import rundir
    from jaxseq.models import model as M
    from jaxseq.training import train_step as T
    from jaxseq.config import ModelConfig, OptimizerConfig
    from jaxseq.parallel.layout import Layout

    model = rundir.init_model(converted, ModelConfig(dropout=0.0, dtype="float32"), seq_len=16)
    assert (model.vocab_size, model.hidden, model.seq_len) == (VOCAB, 64, 16)
    parallel = ParallelConfig(data=2, tensor=4, sequence_parallel=True)
    layout = Layout(model, parallel, make_mesh(parallel, devices))
    state = rundir.init_state(converted, layout, T.make_optimizer(OptimizerConfig(), model))
    _, saved = conversion.load(converted)
    assert state.params["embed"]["token"].shape == (model.padded_vocab(4), 64)
    assert state.params["embed"]["token"].sharding.spec == M.param_specs(model, parallel)["embed"]["token"]
    np.testing.assert_array_equal(np.asarray(state.params["embed"]["token"])[:VOCAB],
                                  np.asarray(saved["embed"]["token"])[:VOCAB])
    np.testing.assert_array_equal(np.asarray(state.params["embed"]["position"]),
                                  np.asarray(saved["embed"]["position"])[:16])
    assert int(state.step) == 0


@pytest.mark.parametrize("change, named", [
    ({"model_type": "mistral"}, "model_type"),
    ({"activation_function": "relu"}, "activation_function"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn"),
    ({"n_inner": 100}, "n_inner"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings"),
    ({"add_cross_attention": True}, "add_cross_attention"),
])
def test_refuses_what_jaxseq_cannot_represent(tmp_path, capsys, change, named):
    config = {**gpt2_config().to_dict(), **change}
    os.makedirs(tmp_path / "hf")
    json.dump(config, open(tmp_path / "hf" / "config.json", "w"))
    assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and named in err and "\n" not in err and "Traceback" not in err


def test_mlp_ratio_from_n_inner():
    from jaxseq.interop.hf import model_config

    assert model_config({**gpt2_config(n_inner=128).to_dict()}).mlp_ratio == 2


def test_round_trip_of_an_older_layout(hf_model, tmp_path):
    """No `transformer.` prefix, float16, causal-mask buffers and a tied lm_head.weight (as older
    uploads have): all come back exactly; an lm_head that differs is refused as untied."""
    from safetensors.numpy import save_file

    src = {k.removeprefix("transformer."): v.astype(np.float16)
           for k, v in load_file(os.path.join(hf_model[1], "model.safetensors")).items()}
    for i in range(2):
        src[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, POSITIONS, POSITIONS), bool))
    src["lm_head.weight"] = src["wte.weight"]
    os.makedirs(tmp_path / "old")
    os.symlink(os.path.join(hf_model[1], "config.json"), tmp_path / "old" / "config.json")
    save_file(src, str(tmp_path / "old" / "model.safetensors"), metadata={"format": "pt"})
    assert convert.main(["from-hf", str(tmp_path / "old"), str(tmp_path / "conv")]) == 0
    assert convert.main(["to-hf", str(tmp_path / "conv"), str(tmp_path / "back")]) == 0
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert list(back) == list(load_file(str(tmp_path / "old" / "model.safetensors")))
    for name, t in src.items():
        assert back[name].dtype == t.dtype and np.array_equal(back[name], t), name

    src["lm_head.weight"] = src["wte.weight"] + np.float16(1)
    save_file(src, str(tmp_path / "old" / "model.safetensors"), metadata={"format": "pt"})
    assert convert.main(["from-hf", str(tmp_path / "old"), str(tmp_path / "conv2")]) == 2


@pytest.mark.slow
def test_train_init_from_then_to_hf(converted, hf_model, tmp_path):
    """`train --init-from` on fsdp=4 × tensor=2 + SP (FSDP: the weights placed and saved in their fsdp shards) with
    lr=0, then to-hf: the weights come back exactly."""
    from commands import command
    from jaxseq import train

    (tmp_path / "text.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    run = str(tmp_path / "run")
    proc = command(train.main, "--init-from", converted, "--data", str(tmp_path / "text.txt"), "--mesh",
                   "fsdp=4,tensor=2", "--sequence-parallel", "--host-devices", "8", "--steps", "1", "--batch-size", "4",
                   "--lr", "0", "--dtype", "float32", "--run-dir", run, "eval_batches=1", "sample_tokens=0",
                   check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "validation loss" in proc.stdout and "sample (prompt" not in proc.stdout  # sample_tokens=0: no sample
    assert convert.main(["to-hf", run, str(tmp_path / "back")]) == 0
    src, back = (load_file(os.path.join(d, "model.safetensors")) for d in (hf_model[1], str(tmp_path / "back")))
    assert sorted(back) == sorted(src)
    for name, t in src.items():
        assert np.array_equal(back[name], t), name


def test_sharded_safetensors(hf_model, tmp_path):
    """A checkpoint split over several files (model.safetensors.index.json) reads the same weights."""
    hf_model[0].save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="40KB")
    assert os.path.isfile(tmp_path / "sharded" / "model.safetensors.index.json")
    (_, sharded), (_, whole) = conversion.load_hf(str(tmp_path / "sharded")), conversion.load_hf(hf_model[1])
    jax.tree.map(np.testing.assert_array_equal, sharded, whole)


def test_logits_refuses_bad_tokens(hf_model):
    from jaxseq.config import ConfigError

    cfg, params = conversion.load_hf(hf_model[1])
    for bad in (np.zeros((1, POSITIONS + 1)), [[0, VOCAB]], [0, 1]):
        with pytest.raises(ConfigError):
            conversion.logits(params, bad, cfg)


@pytest.mark.parametrize("argv, message", [
    (["from-hf"], "error: the following arguments are required: hf_dir, out"),
    (["from-hf", "/nonexistent", "out"], "error: '/nonexistent' has no config.json"),
    (["to-hf", "/nonexistent", "out"], "error: '/nonexistent' has no config.json"),
])
def test_bad_arguments_are_one_line(argv, message, capsys):
    try:
        code = convert.main(argv)
    except SystemExit as e:  # argparse's own errors exit from inside parse_args
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(message) and err.count("\n") == 1, err


def test_greedy_generation_matches_transformers(tmp_path):
    """A random GPT-2 (vocabulary 300, padded to 512 in jaxseq for tensor=4; layer_norm_epsilon 1e-3)
    converted with from-hf and read onto the 8 devices (tensor=4 × data=2): jaxseq's greedy continuation
    with its KV cache equals transformers' `generate(do_sample=False)` (its own KV cache), token for token
    (the prompt holds ids past 256, the padded table has 512 rows)."""
    from jaxseq.training.sampling import sample

    torch.manual_seed(1)
    config = transformers.GPT2Config(vocab_size=300, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                     layer_norm_epsilon=1e-3, bos_token_id=299, eos_token_id=299,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("wpe.weight"):
                p.mul_(20.0)  # positions that matter: a random model's greedy text then varies
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    cfg, params = conversion.load(str(tmp_path / "run"))
    assert (cfg.vocab_size, cfg.ln_eps, params["embed"]["token"].shape[0]) == (300, 1e-3, 512)
    mesh = params["embed"]["token"].sharding.mesh
    assert dict(mesh.shape) == {"pipe": 1, "data": 2, "tensor": 4}

    prompt = [5, 290, 17, 133, 2]
    ours = sample(params, cfg, prompt, 20, temperature=1.0, top_k=1, mesh=mesh)
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=299)
    assert ours == theirs[0, len(prompt):].tolist()
    assert len(set(ours)) > 3  # not a degenerate repetition of one token


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("mesh", [None, "pipe=2,data=2,tensor=2", "tensor=4"])
def test_to_hf_of_a_sharded_restore_is_the_original_byte_for_byte(hf_model, converted, tmp_path, mesh):
    """to-hf reads the params onto a mesh (by default every device: tensor=4 × data=2 for 4 heads; pipe=2 splits
    the layers) and writes one tensor at a time: model.safetensors equals, byte for byte, the file
    `save_pretrained` wrote (what to-hf wrote from a one-device copy before)."""
    argv = ["to-hf", converted, str(tmp_path / "back")] + (["--mesh", mesh] if mesh else [])
    assert convert.main(argv) == 0
    assert [n for n in os.listdir(tmp_path / "back") if "safetensors" in n] == ["model.safetensors"]
    assert (read_bytes(tmp_path / "back" / "model.safetensors")
            == read_bytes(os.path.join(hf_model[1], "model.safetensors")))


def test_a_large_model_is_written_as_sharded_files_that_round_trip(hf_model, converted, tmp_path):
    """Over --max-shard-gb, to-hf writes Hugging Face's sharded layout (model-0000i-of-0000n.safetensors and
    model.safetensors.index.json): transformers loads it with the original logits, from-hf reads it back
    (onto data=2 × tensor=4), and to-hf of that gives the original file byte for byte."""
    sharded, again, back = (str(tmp_path / n) for n in ("sharded", "again", "back"))
    assert convert.main(["to-hf", converted, sharded, "--max-shard-gb", "0.0001"]) == 0  # 100 kB files
    index = json.load(open(os.path.join(sharded, "model.safetensors.index.json")))
    files = sorted(n for n in os.listdir(sharded) if n.endswith(".safetensors"))
    assert len(files) > 2 and files == [f"model-{i:05d}-of-{len(files):05d}.safetensors"
                                        for i in range(1, len(files) + 1)]
    assert sorted(set(index["weight_map"].values())) == files
    original = load_file(os.path.join(hf_model[1], "model.safetensors"))
    assert sorted(index["weight_map"]) == sorted(original)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in original.values())
    model = transformers.GPT2LMHeadModel.from_pretrained(sharded).eval()
    np.testing.assert_allclose(reference_logits(model, TOKENS), reference_logits(hf_model[0], TOKENS), atol=1e-6)
    assert convert.main(["from-hf", sharded, again, "--mesh", "data=2,tensor=4"]) == 0
    assert convert.main(["to-hf", again, back]) == 0
    assert (read_bytes(os.path.join(back, "model.safetensors"))
            == read_bytes(os.path.join(hf_model[1], "model.safetensors")))
    assert convert.main(["to-hf", again, sharded]) == 0  # the same directory, one file now: no stale shards left
    assert [n for n in os.listdir(sharded) if "safetensors" in n] == ["model.safetensors"]


def test_from_hf_writes_the_weights_alone(converted):
    """A converted checkpoint holds the step and the params, not zero Adam moments (a run starts from it with
    fresh ones, --init-from): a third of what a whole train state would put on the devices and the disk."""
    from jaxseq.training import checkpoint as C
    from jaxseq.training import rundir

    mgr = C.reader(rundir.checkpoint_dir(converted))
    assert sorted(mgr.item_metadata(0)["state"]) == ["params", "step"]


def test_from_hf_reads_each_device_block_alone(hf_model, tmp_path, monkeypatch):
    """from-hf onto data=2 × tensor=4 reads the token embedding and the MLP kernels from the file block by block
    (each device's callback asks for its rows or columns only): no read returns as much as half of the tensor
    (128 of the 300 embedding rows at most, a quarter of an MLP kernel). Before, every callback read whole
    tensors and sliced them."""
    from jaxseq.interop import hf

    largest, read = {}, hf.Weights.read

    def recorded(self, name, *index):
        block = read(self, name, *index)
        largest[name] = max(largest.get(name, 0), block.size)
        return block

    monkeypatch.setattr(hf.Weights, "read", recorded)
    assert convert.main(["from-hf", hf_model[1], str(tmp_path / "out"), "--mesh", "data=2,tensor=4"]) == 0
    sizes = {n: t.size for n, t in load_file(os.path.join(hf_model[1], "model.safetensors")).items()}
    blocked = [n for n in sizes if n.endswith(("wte.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"))]
    assert len(blocked) == 1 + 2 * 2
    assert all(largest[n] < sizes[n] / 2 for n in blocked), {n: (largest[n], sizes[n]) for n in blocked}


def test_to_hf_fetches_a_layer_without_gathering_the_leaf(devices):
    """to-hf brings one layer of a stacked leaf at a time to the host. From 8 layers over pipe=8 the compiled
    fetch needs under half the leaf's bytes per device (arguments + output + temporaries: 3/8 of it), and from
    a leaf split over pipe × data × tensor its layer's exact bits (−0.0, inf and NaN included). Before, a dynamic
    index over the split layers gathered the whole leaf onto every device (temporaries of the whole leaf)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    values = np.random.default_rng(0).standard_normal((8, 64, 128)).astype(np.float32)
    values[3, 0, :5], values[3, 1, 0], values[3, 1, 1] = -0.0, np.inf, np.nan
    for parallel, spec in [(ParallelConfig(pipe=8), P("pipe")), (ParallelConfig(pipe=2, data=2, tensor=2),
                                                                  P("pipe", "data", "tensor"))]:
        leaf = jax.device_put(values, NamedSharding(make_mesh(parallel, devices), spec))
        fetched = np.asarray(conversion._layer(leaf, 3))
        assert fetched.tobytes() == values[3].tobytes()
    memory = conversion._layer.lower(jax.device_put(values, NamedSharding(make_mesh(ParallelConfig(pipe=8), devices),
                                                                       P("pipe"))), 3).compile().memory_analysis()
    per_device = memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
    assert per_device < values.nbytes / 2, (per_device, values.nbytes)


def test_the_streaming_writer_holds_one_tensor_at_a_time(tmp_path):
    """`hf.write_dir` computes each tensor when it writes it: writing 40 tensors of 100 kB (4 MB) allocates at most
    a few of them at once, and the file equals safetensors' own writer of the same tensors."""
    import tracemalloc

    from safetensors.numpy import save_file

    from jaxseq.interop import hf

    values = lambda i: np.full((25_000,), i, np.float32)
    tensors = {f"t{i:02d}": hf.Tensor((25_000,), np.dtype(np.float32), lambda i=i: values(i)) for i in range(40)}
    tracemalloc.start()
    hf.write_dir(str(tmp_path / "lazy"), {}, tensors, {"format": "pt"})
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 * 100_000, peak
    save_file({n: values(i) for i, n in enumerate(tensors)}, str(tmp_path / "whole.safetensors"),
              metadata={"format": "pt"})
    assert read_bytes(tmp_path / "lazy" / "model.safetensors") == read_bytes(tmp_path / "whole.safetensors")


def file_mode(path) -> int:
    return os.stat(path).st_mode & 0o777


def umask_mode() -> int:
    """What a file the process creates gets: 0666 less the umask."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


@pytest.mark.parametrize("mask", [0o022, 0o002], ids=["umask-022", "umask-002"])
def test_written_files_follow_the_umask(tmp_path, mask):
    """Every file `hf.write_dir` writes (the safetensors files, which the library creates 0600, the index and
    config.json) gets 0666 less the umask, as any file the user makes: a group or web server can read them."""
    from jaxseq.interop import hf

    tensors = {f"t{i}": hf.Tensor((1000,), np.dtype(np.float32), lambda i=i: np.full((1000,), i, np.float32))
               for i in range(2)}
    old = os.umask(mask)
    try:
        files = hf.write_dir(str(tmp_path / "out"), {}, tensors, max_shard_bytes=4000)
    finally:
        os.umask(old)
    assert len(files) == 2 and sorted(os.listdir(tmp_path / "out")) == sorted([*files, "config.json", hf.INDEX])
    assert {n: file_mode(tmp_path / "out" / n) for n in os.listdir(tmp_path / "out")} == {
        n: 0o666 & ~mask for n in os.listdir(tmp_path / "out")}


def test_generate_and_convert_take_a_mesh(converted, tmp_path):
    """generate on pipe=2 × data=2 × tensor=2 (the heads split over pipe × tensor while sampling) prints the
    greedy text it prints on the default mesh; a mesh the model cannot use is one line."""
    from commands import command
    from jaxseq import generate

    base = ["--run-dir", converted, "--prompt", "ab", "--max-tokens", "12", "--top-k", "1"]
    texts = [command(generate.main, *base, *extra).stdout for extra in ([], ["--mesh", "pipe=2,data=2,tensor=2"],
                                                                         ["--mesh", "data=8,tensor=1"])]
    assert texts[0] == texts[1] == texts[2] and texts[0].startswith("# step 0\nab")
    for main, argv in ((generate.main, base), (convert.main, ["to-hf", converted, str(tmp_path / "x")])):
        done = command(main, *argv, "--mesh", "tensor=3", check=False)
        assert done.returncode == 2 and done.stderr.startswith("error: tensor=3 does not divide heads=4"), done.stderr
        assert done.stderr.count("\n") == 1


def test_round_trip_of_bfloat16(hf_model, tmp_path):
    """A bfloat16 checkpoint (as most recent uploads are; NumPy has no bfloat16): its weights read as float32
    equal torch's, and to-hf writes every tensor back exactly, in bfloat16."""
    model = transformers.GPT2LMHeadModel(hf_model[0].config)
    model.load_state_dict(hf_model[0].state_dict())
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16", safe_serialization=True)
    _, params = conversion.load_hf(str(tmp_path / "bf16"))
    wte = model.transformer.wte.weight.detach().float().numpy()
    assert not np.array_equal(wte, hf_model[0].transformer.wte.weight.detach().numpy())  # rounded: really bf16
    np.testing.assert_array_equal(params["embed"]["token"], wte)
    assert convert.main(["from-hf", str(tmp_path / "bf16"), str(tmp_path / "conv")]) == 0
    assert convert.main(["to-hf", str(tmp_path / "conv"), str(tmp_path / "back")]) == 0
    src = {k: v.float() for k, v in model.state_dict().items()}
    from safetensors.torch import load_file as load_torch

    back = load_torch(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) <= set(src) and "transformer.wte.weight" in back
    for name, t in back.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t.float(), src[name]), name
