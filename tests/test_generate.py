"""Sampling: the KV cache gives the tokens recomputing the whole window gives, on one device and from a
pipelined train state resharded for sampling (never gathered); a seed fixes the sample; the prompt of an
empty string and of the end-of-run sample. (Greedy decoding against transformers' `generate` is in
test_convert.py, beside the other comparisons.)"""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxseq.config import OptimizerConfig, ParallelConfig, replace
from jaxseq.presets import preset
from jaxseq.mesh import make_mesh
from jaxseq.models import model as M
from jaxseq.sharding import Sharder
from jaxseq.training import rundir
from jaxseq.training import sampling as S
from jaxseq.training import train_step as T
from jaxseq.training.data import Corpus, decode_tokens, encode_text, train_bpe
from jaxseq.parallel.layout import Layout

# A vocabulary that needs padding (300 → 384 rows) and a non-default LayerNorm epsilon; positions scaled up
# so that a random model's greedy text depends on where it is (sliding the window then changes it).
CFG = replace(preset("tiny"), seq_len=16, vocab_size=300, ln_eps=1e-3, dtype="float32", dropout=0.0)
PROMPT = [5, 290, 17, 133]


@pytest.fixture(scope="module")
def params():
    p = M.init_params(jax.random.key(0), CFG, 1)
    p["embed"]["position"] = 50 * p["embed"]["position"]
    return p


@jax.jit
def _window_logits(params, window):
    return M.logits_fn(params, M.hidden_states(params, window, CFG, Sharder(None), "none"), CFG, Sharder(None))


def window_greedy(params, prompt, n):
    """Greedy tokens computed as sampling did before the cache: the whole window (the last seq_len tokens,
    padded after: attention is causal) recomputed for every token."""
    tokens = list(prompt)
    for _ in range(n):
        context = tokens[-CFG.seq_len:]
        window = np.zeros((1, CFG.seq_len), np.int32)
        window[0, : len(context)] = context
        logits = np.asarray(_window_logits(params, window))[0, len(context) - 1, : CFG.vocab_size]
        tokens.append(int(np.argmax(logits)))
    return tokens[len(prompt):]


def test_kv_cache_gives_the_window_recomputing_tokens(params, monkeypatch):
    """30 greedy tokens after a 4-token prompt with seq_len 16: one prefill of the prompt, 12 decode steps
    against the cache (the window is then full), then the window slides, recomputed for each of the other 17
    tokens; the tokens equal recomputing the window every time."""
    calls = {"_prefill": 0, "_decode": 0}
    for name in calls:
        fn = getattr(S, name)
        monkeypatch.setattr(S, name, lambda *a, fn=fn, name=name, **kw: (calls.__setitem__(name, calls[name] + 1),
                                                                          fn(*a, **kw))[1])
    ours = S.sample(params, CFG, PROMPT, 30, temperature=1.0, top_k=1)
    assert calls == {"_prefill": 1 + 17, "_decode": 12}
    assert ours == window_greedy(params, PROMPT, 30)
    assert len(set(ours)) > 3  # not a degenerate repetition of one token


def test_decode_is_one_position_against_the_cache(params):
    """The compiled decode step computes one position (its FLOPs a small fraction of the prefill's whole
    window) and updates the cache in place (donated), the cache shaped [layers, 1, seq_len, heads, head_dim]."""
    shard = S.OneSequence(None)
    key, temp = jax.random.key(0), np.float32(1.0)
    window = np.zeros((1, CFG.seq_len), np.int32)
    prefill = S._prefill.lower(params, window, 4, key, 0, temp, CFG, shard, 1).compile()
    _, cache = S._prefill(params, window, 4, key, 0, temp, CFG, shard, 1)
    assert [c.shape for c in cache] == [(CFG.layers, 1, CFG.seq_len, CFG.heads, CFG.head_dim)] * 2
    decode = S._decode.lower(params, cache, np.zeros((1,), np.int32), 4, key, 1, temp, CFG, shard, 1).compile()
    assert decode.cost_analysis()["flops"] < prefill.cost_analysis()["flops"] / 4
    assert "input_output_alias" in decode.as_text()  # the cache's buffers are reused


def test_sampling_from_a_pipelined_state_reshards_it(params, devices):
    """The train state of pipe=2 × data=2 × tensor=2 with the distributed optimizer (layers over pipe, masters
    split over data): `resharding` moves it to tensor=4 (pipe × tensor) × data=2, each device holding a
    quarter of every layer weight (as many bytes as in training), never the whole; the cache splits its heads
    over tensor like the attention; the greedy tokens equal one device's."""
    parallel = ParallelConfig(pipe=2, data=2, tensor=2, distributed_optimizer=True)
    mesh = make_mesh(parallel, devices)
    masters = T.state_shardings(Layout(CFG, parallel, mesh), T.make_optimizer(OptimizerConfig(), CFG)).params
    placed = jax.device_put(rundir.place(params, CFG, mesh), masters)
    assert placed["layers"]["mlp"]["wi"]["kernel"].sharding.spec == P("pipe", "data", "tensor")
    move, sampling_mesh = S.resharding(CFG, mesh)
    ready = move(placed)
    assert dict(sampling_mesh.shape) == {"pipe": 1, "data": 2, "tensor": 4}
    for leaf, spec in zip(jax.tree.leaves(ready),
                          jax.tree.leaves(M.param_specs(CFG, ParallelConfig(data=2, tensor=4)))):
        assert leaf.sharding.spec == spec
    for leaf in jax.tree.leaves(ready["layers"]["attn"]) + jax.tree.leaves(ready["layers"]["mlp"]["wi"]):
        if leaf.ndim > 2:  # the kernels: a quarter of each on every device
            assert all(s.data.size == leaf.size // 4 for s in leaf.addressable_shards)
    _, cache = S._prefill(ready, np.zeros((1, CFG.seq_len), np.int32), 4, jax.random.key(0), 0, np.float32(1.0), CFG,
                          S.OneSequence(sampling_mesh), 1)
    assert cache[0].sharding.is_equivalent_to(NamedSharding(sampling_mesh, P(None, None, None, "tensor", None)), 5)
    assert (S.sample(ready, CFG, PROMPT, 20, temperature=1.0, top_k=1, mesh=sampling_mesh)
            == window_greedy(params, PROMPT, 20))


@pytest.mark.slow
def test_sampling_from_pipe_8_gathers_no_model_onto_a_device(devices):
    """A train state with its 8 layers over pipe=8 (each device holds one layer): every program the end-of-run
    sample compiles needs less than half the whole model's bytes per device (arguments + outputs + temporaries
    − aliased, memory_analysis()): the reshard to tensor=8 holds its eighth of the train state, its eighth of
    the sampling layout and one staging buffer (0.48×); the prefill and decode an eighth plus the cache (0.22×).
    Sampling from the pipe-sharded params as they were (before) needed 1.39× the whole model per device: XLA
    gathered every layer onto every device."""
    cfg = replace(CFG, layers=8, seq_len=64, vocab_size=256)
    parallel = ParallelConfig(pipe=8)
    mesh = make_mesh(parallel, devices)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), M.param_specs(cfg, parallel))
    state_params = jax.jit(lambda k: M.init_params(k, cfg, 1), out_shardings=shardings)(jax.random.key(0))
    whole = sum(x.nbytes for x in jax.tree.leaves(state_params))
    per_device = lambda c: (lambda m: m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                            - m.alias_size_in_bytes)(c.memory_analysis())
    move, sampling_mesh = S.resharding(cfg, mesh)
    assert dict(sampling_mesh.shape) == {"pipe": 1, "data": 1, "tensor": 8}
    programs = S.compile_sampler(state_params, cfg, mesh)  # what the loop compiles before the first step
    for name in ("reshard", "prefill", "decode"):
        program = getattr(programs, name)
        assert per_device(program) < whole / 2, (name, per_device(program), whole)
    # The programs compiled ahead sample what the jitted functions sample (past seq_len: prefills and decodes)
    prompt = [t % cfg.vocab_size for t in PROMPT]
    ahead = S.sample(programs.reshard(state_params), cfg, prompt, 70, seed=3, programs=programs)
    assert ahead == S.sample(move(state_params), cfg, prompt, 70, seed=3, mesh=sampling_mesh)


def test_seeded_sampling(params):
    a = S.sample(params, CFG, [1, 2, 3], 20, temperature=1.0, top_k=0, seed=7)  # runs past seq_len=16
    assert a == S.sample(params, CFG, [1, 2, 3], 20, temperature=1.0, top_k=0, seed=7)
    assert a != S.sample(params, CFG, [1, 2, 3], 20, temperature=1.0, top_k=0, seed=8)
    assert len(a) == 20 and all(0 <= t < CFG.vocab_size for t in a)


def test_bytes_round_trip():
    text = "héllo\n\tworld"
    assert decode_tokens(encode_text(text, None), None) == text


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE with no special tokens, and the one `jaxseq.data` trains (<|endoftext|> its last id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tmp = tmp_path_factory.mktemp("bpe")
    (tmp / "text.txt").write_text("def f(x):\n    return x + 1\n" * 50 + "class A:\n    pass\n" * 50)
    plain = Tokenizer(models.BPE())
    plain.pre_tokenizer, plain.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    plain.train([str(tmp / "text.txt")], trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    plain.save(str(tmp / "plain.json"))
    train_bpe([str(tmp / "text.txt")], 300).save(str(tmp / "eot.json"))
    return str(tmp / "plain.json"), str(tmp / "eot.json")


def test_an_empty_prompt_is_the_start_of_a_document(bpe, params):
    """Bytes: the end-of-document id 256 that ends every document (a newline for a model of the 256 byte
    values alone). A BPE without special tokens: the newline as it encodes it (not the byte id 10, which is
    some other token there). With <|endoftext|>: that token. An id outside the vocabulary: one line."""
    from tokenizers import Tokenizer

    plain, eot = bpe
    assert S.prompt_ids("", None, 257) == [256] and S.prompt_ids("", None, 256) == [10]
    newline = Tokenizer.from_file(plain).encode("\n").ids
    assert S.prompt_ids("", plain, 300) == newline and newline != [10]
    assert Tokenizer.from_file(plain).decode(S.prompt_ids("", plain, 300)) == "\n"
    eot_id = Tokenizer.from_file(eot).token_to_id("<|endoftext|>")
    assert S.prompt_ids("", eot, 300) == [eot_id] == [Tokenizer.from_file(eot).get_vocab_size() - 1]  # its last id
    assert S.prompt_ids("def", plain, 300) == encode_text("def", plain)
    assert len(S.sample(params, CFG, S.prompt_ids("", eot, 300), 3)) == 3
    with pytest.raises(ValueError, match="the prompt is empty"):
        S.sample(params, CFG, [], 3)
    with pytest.raises(ValueError, match=r"^the prompt holds token id 300, outside the model's vocabulary of 300 ids"):
        S.sample(params, CFG, [1, 300], 3)


def test_the_end_of_run_prompt_is_the_start_of_a_validation_document(bpe):
    """The first line of the validation split, bytes or BPE, not a fixed "def "."""
    val = b"The quick brown fox\njumps over\n"
    corpus = Corpus(train=np.zeros(10, np.uint8), val=np.frombuffer(val, np.uint8), vocab_size=256, name="t")
    assert S.validation_prompt(corpus, 64) == "The quick brown fox\n"
    assert S.validation_prompt(corpus, 9) == "The quick"  # at most that many tokens
    plain = bpe[0]
    ids = np.asarray(encode_text("class A:\n    pass\n", plain), np.uint32)
    corpus = Corpus(train=ids, val=ids, vocab_size=300, name="t", tokenizer=plain)
    assert S.validation_prompt(corpus, 64) == "class A:\n"


@pytest.mark.slow  # a train step, its resume and a sampler compiled
def test_a_run_a_gpu_saved_with_unrolled_layers_samples_and_resumes_on_a_cpu(tmp_path):
    """A GPU run's layers are unrolled unless it asks otherwise (`config.default_layer_loop`), and its config.json
    says so; on a CPU, where unrolled layers are refused when asked for, `generate` and a resume take the CPU's
    scan instead: the loop is a choice of the platform, as its kernels are."""
    import json

    from commands import command
    from jaxseq import generate as generate_command
    from jaxseq import train as train_command

    run_dir = str(tmp_path)
    tiny = ["--preset", "tiny", "--dtype", "float32", "--mesh", "data=8", "--batch-size", "8", "--log-every", "1",
            "--eval-every", "100", "--checkpoint-every", "1", "sample_tokens=0", "--run-dir", run_dir]
    command(train_command.main, *tiny, "--steps", "1")
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    assert saved["model"]["layer_loop"] == "scan"
    saved["model"]["layer_loop"] = "unrolled"  # as the same run on a GPU saves it
    path.write_text(json.dumps(saved))
    out = command(generate_command.main, "--run-dir", run_dir, "--prompt", "def", "--max-tokens", "3").stdout
    assert out.startswith("# step 1\ndef")
    command(train_command.main, *tiny, "--steps", "2", "--resume")
    assert json.loads(path.read_text())["model"]["layer_loop"] == "scan"
