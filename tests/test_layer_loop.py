"""`ModelConfig.layer_loop`: the layers under `lax.scan` (the default) or unrolled (models/model.layers): the same
loss and gradients; unrolled refused on CPU. On a GPU's program (compiled for the H100 here):
tests/test_gpu_target.py."""

import jax
import jax.numpy as jnp
import pytest

from jaxseq.config import ConfigError, ModelConfig, ParallelConfig, on_platform, replace, validate
from jaxseq.models import model as M
from jaxseq.sharding import Sharder

CFG = ModelConfig(vocab_size=256, seq_len=32, hidden=64, heads=4, layers=3, dtype="float32", dropout=0.1)


def test_unrolled_layers_compute_the_scans_loss_and_gradients():
    """Dropout included: layer i draws from keys[i] in both loops."""
    params = M.init_params(jax.random.key(0), CFG)
    tokens = jax.random.randint(jax.random.key(1), (2, CFG.seq_len + 1), 0, CFG.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    for remat in ("none", "full"):
        def run(cfg):
            loss = lambda p: M.loss_fn(p, batch, cfg, Sharder(None), remat, key=jax.random.key(2))
            return jax.jit(jax.value_and_grad(loss))(params)

        (scan_loss, scan_grads), (loop_loss, loop_grads) = run(CFG), run(replace(CFG, layer_loop="unrolled"))
        assert float(loop_loss) == pytest.approx(float(scan_loss), rel=1e-6)
        for a, b in zip(jax.tree.leaves(scan_grads), jax.tree.leaves(loop_grads)):
            assert jnp.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_unrolled_layers_gradient_is_one_concatenate_per_weight_not_a_sum_of_pads():
    """The layers' weights are split out of their stacks (`M.unstack`: `lax.split`), so each stacked weight's
    gradient is one concatenate of the layers' gradients. Indexed (`a[i]`) it was k zero-pads summed, which XLA:GPU
    fused into the clipping norm's reduction: 55 ms per step for each attention weight of gpt3-1.3b, the unrolled
    step 1.44× the scan's where it is now 0.86× (an H100, experiments/results/gpu_h100_2026-11-27/)."""
    cfg = replace(CFG, layer_loop="unrolled", dropout=0.0)
    params = M.init_params(jax.random.key(0), cfg)
    tokens = jax.random.randint(jax.random.key(1), (2, cfg.seq_len + 1), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    grad = jax.grad(lambda p: M.loss_fn(p, batch, cfg, Sharder(None), "none"))
    text = str(jax.make_jaxpr(grad)(params))
    assert " pad[" not in text
    assert text.count("concatenate[dimension=0]") == len(jax.tree.leaves(params["layers"]))


def test_a_layer_loop_not_known_or_unrolled_on_cpu_is_one_line():
    """On XLA:CPU the unrolled layers lose their remat policy (selective's replay merged with the forward, `full`
    holding more than `none`; on XLA:GPU they keep it: tests/test_gpu_target.py), so a CPU run refuses them."""
    with pytest.raises(ConfigError, match="layer_loop='while' is not valid; valid: scan, unrolled"):
        validate(replace(CFG, layer_loop="while"), ParallelConfig(), "none")
    with pytest.raises(ConfigError, match="layer_loop='unrolled' on CPU: XLA:CPU does not keep a remat policy"):
        on_platform(replace(CFG, layer_loop="unrolled"), "cpu")
    assert on_platform(replace(CFG, layer_loop="unrolled"), "gpu").layer_loop == "unrolled"


def test_a_search_for_unrolled_layers_prices_no_scan_stacks():
    """`plan --search --layer-loop unrolled`: the model's layers run unrolled, so the time model leaves the scan's
    stacks out (`TimeModel.scan_stacks`); the layers are still measured scanned (`Compiler`)."""
    from jaxseq import plan
    from jaxseq.planning.measure import Compiler

    argv = ["--search", "--preset", "tiny", "--gpus", "8", "--global-batch", "8"]
    parser = plan.build_parser()
    assert plan.search_request(parser.parse_args(argv)).time_model.scan_stacks
    unrolled = parser.parse_args(argv + ["--layer-loop", "unrolled"])
    assert not plan.search_request(unrolled).time_model.scan_stacks
    assert plan.resolve(unrolled).layer_loop == "unrolled" and plan.resolve(unrolled).dropout == 0.1  # the preset's
    assert plan.resolve(parser.parse_args(argv + ["--dropout", "0"])).dropout == 0.0  # as the H100's runs
    assert Compiler(plan.resolve(unrolled), 1, jax.devices()[:1]).cfg.layer_loop == "scan"
