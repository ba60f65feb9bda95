"""The Llama family trains and samples as GPT does: loss and every gradient (float32, dropout 0 and 0.1) equal
one device's on every mesh, remat policy, pipeline schedule, with the distributed optimizer and with gradient
accumulation; the KV cache gives the window-recomputing tokens; the train command runs it; bad Llama settings
are one line. tiny-llama has 8 query heads sharing 2 K/V heads: tensor=2 splits the K/V heads, tensor=4 and 8
repeat each over 2 and 4 ranks."""

import json
import os

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxseq.config import ConfigError, ParallelConfig, replace, validate
from jaxseq.presets import preset
from jaxseq.mesh import make_mesh
from jaxseq.models import model as M
from jaxseq.parallel import pipeline as PL
from jaxseq.parallel.layout import Layout
from jaxseq.remat import POLICIES
from jaxseq.sharding import Sharder
from jaxseq.training import aot
from jaxseq.training import sampling as S
from jaxseq.training import train_step as T

CFG = replace(preset("tiny-llama"), dtype="float32")
DROPOUTS = (0.0, 0.1)
# name → (mesh, remat policy): K/V heads repeated (tensor=4, 8) or split (tensor=2).
MESHES = {
    "data=2,tensor=4+sp": (ParallelConfig(data=2, tensor=4, sequence_parallel=True), "selective"),
    "tensor=8+sp": (ParallelConfig(data=1, tensor=8, sequence_parallel=True), "full"),
    "data=4,tensor=2": (ParallelConfig(data=4, tensor=2), "none"),
}


def _batch(cfg, n=8, seed=0):
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (n, cfg.seq_len + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _params(cfg=CFG):
    """One parameter set for every mesh: padded for the largest tensor size (padding rows are masked)."""
    return M.init_params(jax.random.key(1), cfg, tensor=8)


def loss_and_grads(parallel: ParallelConfig, remat: str, dropout: float):
    cfg = replace(CFG, dropout=dropout)
    layout = Layout(cfg, parallel, make_mesh(parallel, jax.devices()[: parallel.num_devices]))
    loss, grads = T.make_loss_and_grad(layout, remat)(_params(), _batch(cfg), jax.random.key(2))
    return float(loss), jax.device_get(grads)


@pytest.fixture(scope="module")
def reference(devices):
    """dropout → (loss, grads) on one device, remat none; each computed once for the module."""
    cache = {}

    def get(dropout):
        if dropout not in cache:
            cache[dropout] = loss_and_grads(ParallelConfig(), "none", dropout)
        return cache[dropout]

    return get


def assert_same(result, reference, rtol=1e-5):
    """test_parallel's tolerance: the loss, and every gradient relative to its largest entry."""
    loss, grads = result
    ref_loss, ref_grads = reference
    assert abs(loss - ref_loss) <= rtol * abs(ref_loss), (loss, ref_loss)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        scale = np.max(np.abs(r))
        assert scale > 0, jax.tree_util.keystr(path)  # every parameter gets a gradient
        err = np.max(np.abs(np.asarray(g) - r)) / scale
        assert err <= rtol, f"{jax.tree_util.keystr(path)}: relative error {err:.2e}"


def test_kv_heads_split_over_tensor_or_repeated():
    """tensor=2 divides the 2 K/V heads: the kernel splits over `tensor`; tensor=4 is a multiple of them: the
    kernel is whole on every rank (each takes its head's slice), and the sampling cache holds 4 heads."""
    spec = lambda t: M.param_specs(CFG, ParallelConfig(tensor=t))["layers"]["attn"]["kv"]["kernel"]
    assert spec(2) == P(None, None, None, "tensor", None)
    assert "tensor" not in jax.tree.leaves(tuple(spec(4))) and "tensor" not in jax.tree.leaves(tuple(spec(8)))
    assert M.family(CFG).cache_heads(CFG, 4) == 4 and M.family(CFG).cache_heads(CFG, 2) == 2


def test_dropout_is_on(reference):
    """Guard: the dropout 0.1 comparisons would be vacuous if dropout did nothing."""
    batch = _batch(CFG)
    no_dropout = float(jax.jit(lambda p: M.loss_fn(p, batch, CFG, Sharder(None), "none"))(_params()))
    assert abs(no_dropout - reference(0.1)[0]) > 1e-4


def _cases(names, fast):
    """(name, dropout) for every name and dropout, slow except `fast`."""
    return [pytest.param(n, d, id=f"{n}-dropout={d}", marks=() if (n, d) == fast else pytest.mark.slow)
            for n in names for d in DROPOUTS]


# The fast tier keeps the repeated-K/V mesh with dropout.
@pytest.mark.parametrize("mesh_name,dropout", _cases(MESHES, ("data=2,tensor=4+sp", 0.1)))
def test_mesh_matches_single_device(mesh_name, dropout, reference):
    parallel, remat = MESHES[mesh_name]
    assert_same(loss_and_grads(parallel, remat, dropout), reference(dropout))


# Slow: the fast tier's mesh case runs `selective`.
@pytest.mark.slow
@pytest.mark.parametrize("remat", [p for p in POLICIES if p != "none"])
def test_remat_policy_matches_none(remat, reference):
    """Every policy recomputes RMSNorm, RoPE, SwiGLU and the dropout masks to the same gradients (against the
    one compiled baseline: one device, nothing recomputed)."""
    assert_same(loss_and_grads(MESHES["data=2,tensor=4+sp"][0], remat, 0.1), reference(0.1))


# ---------------------------------------------------------------------------------------------
# The pipeline: 8 layers (divisible by p·v = 2 and 8), micro-batches of 2 sequences.

PIPE_CFG = replace(CFG, layers=8, seq_len=16)
MICRO = 2
# (schedule, p, v, m, data, tensor, sequence parallel): 1F1B with repeated K/V heads (tensor=4 + SP inside
# the stages), interleaved with data=2.
PIPE_CASES = {"1f1b-p2-tensor=4+sp": ("1f1b", 2, 1, 4, 1, 4, True),
              "interleaved-p4v2-data=2": ("interleaved", 4, 2, 8, 2, 1, False)}


def mean_of_micro_batches(fn, params, batch, key, m):
    """(loss, grads): the mean over micro-batch i of fn(params, rows i, fold_in(key, i)), as accumulation and
    the pipeline compute them."""
    rows = len(batch["inputs"]) // m
    parts = [fn(params, {k: v[i * rows:(i + 1) * rows] for k, v in batch.items()}, jax.random.fold_in(key, i))
             for i in range(m)]
    return (float(np.mean([float(loss) for loss, _ in parts])),
            jax.tree.map(lambda *g: np.mean(np.stack(g), axis=0), *[jax.device_get(g) for _, g in parts]))


# All slow (the 1F1B row with dropout, 11 s, was the fast tier's longest): tests/test_pipeline.py holds the executor
# in the fast tier; the whole suite runs every row.
@pytest.mark.parametrize("name,dropout", _cases(PIPE_CASES, None))
def test_pipeline_equals_unpipelined(name, dropout, devices):
    """The executor carries the family's non-layer groups (embed, final_norm, lm_head) on every stage. RoPE's
    frequencies are a constant among a chunk's residuals (invariant over `pipe` and `data`): the stash holds
    them varying, as every value the tick loop carries."""
    cfg = replace(PIPE_CFG, dropout=dropout)
    schedule, p, v, m, data, tensor, sp = PIPE_CASES[name]
    parallel = ParallelConfig(data=data, tensor=tensor, sequence_parallel=sp, pipe=p, schedule=schedule,
                              virtual_stages=v)
    layout = Layout(cfg, parallel, make_mesh(parallel, devices[:parallel.num_devices]))
    params = M.init_params(jax.random.key(0), cfg)
    abstract, _ = aot.abstract_inputs(layout, MICRO * m)
    batch, key = _batch(cfg, MICRO * m), jax.random.key(7)
    placed = jax.tree.map(lambda a, s: jax.device_put(a, s.sharding), params, abstract)
    loss, grads = PL.make_loss_and_grad(layout, "selective", m)(placed, batch, key)
    one = T.make_loss_and_grad(Layout(cfg, ParallelConfig(), make_mesh(ParallelConfig(), devices[:1])), "selective")
    assert_same((float(loss), jax.device_get(grads)), mean_of_micro_batches(one, params, batch, key, m))


# ---------------------------------------------------------------------------------------------
# The train step: the distributed optimizer, gradient accumulation. The optimizer is optax.trace(0): its state
# is the step's gradient, exactly (an update read as params − new params loses float32 digits to cancellation).

STEP_CASES = {"distributed-optimizer": (ParallelConfig(data=4, tensor=2, sequence_parallel=True,
                                                       distributed_optimizer=True), 1),
              "accumulation": (ParallelConfig(data=2, tensor=4, sequence_parallel=True), 2)}


# The fast tier keeps accumulation with dropout.
@pytest.mark.parametrize("name,dropout", _cases(STEP_CASES, ("accumulation", 0.1)))
def test_train_step_gradient_equals_single_device(name, dropout, devices):
    """The step's gradient is one device's: of the whole batch (the distributed optimizer: masters split
    over `data`, gradients reduce-scattered onto them), or the mean of the micro-batches' (key fold_in(key, i))."""
    cfg = replace(CFG, dropout=dropout)
    parallel, micro_batches = STEP_CASES[name]
    layout = Layout(cfg, parallel, make_mesh(parallel, devices[:parallel.num_devices]))
    optimizer = optax.trace(0.0)
    params, batch = _params(), _batch(cfg)
    state = T.state_from_params(params, layout, optimizer)
    if parallel.distributed_optimizer:
        assert "data" in jax.tree.leaves(tuple(state.opt_state.trace["layers"]["attn"]["kv"]["kernel"].sharding.spec))
    step = T.make_train_step(layout, "selective", optimizer, micro_batches, donate=False)
    state, metrics = step(state, batch, jax.random.key(1))
    one = T.make_loss_and_grad(Layout(cfg, ParallelConfig(), make_mesh(ParallelConfig(), devices[:1])), "none")
    key = jax.random.fold_in(jax.random.key(1), 0)  # step 0's key
    expected = one(params, batch, key) if micro_batches == 1 else \
        mean_of_micro_batches(one, params, batch, key, micro_batches)
    assert_same((float(metrics["loss"]), jax.device_get(state.opt_state.trace)),
                (float(expected[0]), jax.device_get(expected[1])))


# ---------------------------------------------------------------------------------------------
# Sampling: the KV cache (K/V heads as a layer computes them: 2, or 4 repeated on tensor=4) gives the tokens
# that recomputing the whole window gives. seq_len 16: 30 tokens after a 4-token prompt prefill, decode
# against the cache, then slide the window.

SAMPLE_CFG = replace(CFG, seq_len=16)
PROMPT = [5, 200, 17, 133]


@pytest.fixture(scope="module")
def sample_params():
    return M.init_params(jax.random.key(0), SAMPLE_CFG)


@pytest.fixture(scope="module")
def window_greedy(sample_params):
    """30 greedy tokens after PROMPT, the whole window (the last seq_len tokens, padded after: attention is
    causal) recomputed for every token from M.hidden_states and M.logits_fn, no cache."""
    logits = jax.jit(lambda p, w: M.logits_fn(p, M.hidden_states(p, w, SAMPLE_CFG, Sharder(None), "none"),
                                             SAMPLE_CFG, Sharder(None)))
    tokens = list(PROMPT)
    for _ in range(30):
        context = tokens[-SAMPLE_CFG.seq_len:]
        window = np.zeros((1, SAMPLE_CFG.seq_len), np.int32)
        window[0, : len(context)] = context
        tokens.append(int(np.argmax(np.asarray(logits(sample_params, window))[0, len(context) - 1,
                                                                              : SAMPLE_CFG.vocab_size])))
    assert len(set(tokens[len(PROMPT):])) > 3  # not a degenerate repetition of one token
    return tokens[len(PROMPT):]


def test_kv_cache_sampling_equals_window_recomputing(sample_params, window_greedy):
    assert S.sample(sample_params, SAMPLE_CFG, PROMPT, 30, temperature=1.0, top_k=1) == window_greedy


def test_sampling_on_a_mesh_repeats_the_kv_heads(sample_params, window_greedy, devices):
    """data=2 × tensor=4: the sampling layout keeps tensor=4 (it divides the heads and the MLP, and is a multiple
    of the 2 K/V heads); the cache holds 4 K/V heads, one per tensor rank."""
    parallel = ParallelConfig(data=2, tensor=4)
    mesh = make_mesh(parallel, devices)
    placed = jax.device_put(sample_params, jax.tree.map(lambda s: NamedSharding(mesh, s),
                                                        M.param_specs(SAMPLE_CFG, parallel)))
    move, sampling_mesh = S.resharding(SAMPLE_CFG, mesh)
    assert dict(sampling_mesh.shape) == {"pipe": 1, "data": 2, "tensor": 4}
    ready = move(placed)
    _, cache = S._prefill(ready, np.zeros((1, SAMPLE_CFG.seq_len), np.int32), 4, jax.random.key(0), 0,
                          np.float32(1.0), SAMPLE_CFG, S.OneSequence(sampling_mesh), 1)
    assert cache[0].shape == (SAMPLE_CFG.layers, 1, SAMPLE_CFG.seq_len, 4, SAMPLE_CFG.head_dim)
    assert cache[0].sharding.is_equivalent_to(NamedSharding(sampling_mesh, P(None, None, None, "tensor", None)), 5)
    assert S.sample(ready, SAMPLE_CFG, PROMPT, 30, temperature=1.0, top_k=1, mesh=sampling_mesh) == window_greedy


# ---------------------------------------------------------------------------------------------
# Bad Llama settings: one line naming the value


@pytest.mark.parametrize("model,parallel,message", [
    (replace(CFG, kv_heads=3), ParallelConfig(), "kv_heads=3 must be a positive integer dividing heads=8"),
    (replace(CFG, hidden=96, heads=12, kv_heads=4), ParallelConfig(tensor=6),
     "tensor=6 neither divides kv_heads=4 nor is a multiple of it"),
    (replace(CFG, rope_scaling="yarn"), ParallelConfig(), "rope_scaling='yarn' is not a known RoPE scaling"),
    (replace(preset("tiny"), kv_heads=2), ParallelConfig(), "kv_heads=2 is a Llama-family setting"),
    (replace(CFG, family="mamba"), ParallelConfig(), "family='mamba' is not valid; valid: gpt, llama"),
], ids=["kv-heads", "tensor-vs-kv-heads", "rope-scaling", "gpt-kv-heads", "family"])
def test_bad_llama_settings_are_one_line_errors(model, parallel, message):
    with pytest.raises(ConfigError, match=message) as e:
        validate(model, parallel, "selective")
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# The train command

TINY_LLAMA = ["--preset", "tiny-llama", "--dtype", "float32", "--batch-size", "8", "--host-devices", "8",
              "--steps", "3", "--log-every", "1", "--eval-every", "100", "--warmup-steps", "1", "eval_batches=1",
              "sample_tokens=8"]


@pytest.mark.slow
def test_train_command_gives_the_same_losses_on_two_meshes(tmp_path):
    """`python -m jaxseq.train --preset tiny-llama` (the embedded corpus) on data=2 × tensor=4 + SP (K/V heads
    repeated) and on data=8: the same losses within test_train.py's tolerance across meshes (1e-4)."""
    from test_train import losses, run

    runs = {"data=2,tensor=4": "data=2 × tensor=4 + SP", "data=8,tensor=1": "data=8 × tensor=1"}
    # The first run draws the end-of-run sample (the cache of K/V heads repeated over tensor=4); the second
    # compiles no sampler.
    sample = {"data=2,tensor=4": [], "data=8,tensor=1": ["sample_tokens=0"]}
    for mesh, shown in runs.items():
        runs[mesh] = str(tmp_path / mesh)
        out = run(*TINY_LLAMA, "--mesh", mesh, "--run-dir", runs[mesh], *sample[mesh]).stdout
        assert f"mesh {shown} on 8 cpu devices" in out
        assert ("sample (prompt" in out) == (not sample[mesh])
    tensor, data = (losses(d) for d in runs.values())
    assert sorted(tensor) == [1, 2, 3]
    for step in tensor:
        assert abs(tensor[step] - data[step]) <= 1e-4 * abs(data[step]), (step, tensor[step], data[step])
    assert json.load(open(os.path.join(runs["data=8,tensor=1"], "config.json")))["model"]["family"] == "llama"


def test_a_yaml_config_selects_the_family(tmp_path):
    """`preset: tiny-llama` in a --config file is the Llama family with its fields (a Llama field overridden
    there); `family: llama` over the default GPT preset makes that shape a Llama."""
    from jaxseq.train import build_parser, configs_from_args

    model = lambda text: configs_from_args(build_parser().parse_intermixed_args(
        ["--config", str((tmp_path / "run.yaml").write_text(text) and tmp_path / "run.yaml")]))[0]["model"]
    named = model("preset: tiny-llama\nmodel:\n  kv_heads: 4\n")
    assert (named.family, named.kv_heads, named.ffn_hidden) == ("llama", 4, 176)
    made = model("family: llama\nkv_heads: 2\nrope_theta: 500000\n")
    assert (made.family, made.kv_heads, made.rope_theta) == ("llama", 2, 500000.0)


def test_the_train_command_refuses_bad_kv_heads_in_one_line(tmp_path):
    from test_train import run

    out = run(*TINY_LLAMA, "--run-dir", str(tmp_path), "kv_heads=3", check=False)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["error: kv_heads=3 must be a positive integer dividing heads=8"]


@pytest.mark.slow
def test_pipelined_train_command_matches_and_resumes_on_another_mesh(tmp_path):
    """pipe=2 × data=2 × tensor=2 + SP with the distributed optimizer (1F1B, 4 micro-batches, 4 layers): the
    losses and the pipelined evaluation of data=2 × tensor=4 (1e-4: another mesh); its checkpoint resumes on
    data=2 × tensor=4 (the K/V kernel, split over tensor=2, whole there) with the reference's step-3 loss."""
    from test_train import losses, metrics, run

    base = [*TINY_LLAMA, "--micro-batch-size", "2", "layers=4", "decay_steps=4", "--eval-every", "2",
            "--checkpoint-every", "2"]
    piped, ref = str(tmp_path / "piped"), str(tmp_path / "ref")
    out = run(*base, "--mesh", "pipe=2,data=2,tensor=2", "--distributed-optimizer", "--steps", "2", "--run-dir", piped)
    assert "mesh pipe=2 × data=2 × tensor=2 + SP + distributed optimizer, 1f1b schedule" in out.stdout
    assert "sample (prompt" in out.stdout  # sampled from the pipelined run's weights; the two below compile no sampler
    run(*base, "--mesh", "data=2,tensor=4", "--steps", "3", "--run-dir", ref, "sample_tokens=0")
    run(*base, "--mesh", "data=2,tensor=4", "--steps", "3", "--run-dir", piped, "--resume", "sample_tokens=0")
    got, want = losses(piped), losses(ref)
    assert sorted(got) == [1, 2, 3]
    for step in got:
        assert abs(got[step] - want[step]) <= 1e-4 * abs(want[step]), (step, got[step], want[step])
    val = lambda run_dir: next(m["val_loss"] for m in metrics(run_dir) if m["step"] == 2)
    assert abs(val(piped) - val(ref)) <= 1e-4 * val(ref)
