"""The distributed optimizer (ZeRO-1): fp32 master weights and Adam moments sharded over `data`.

Same losses as without it, state bytes per device from the compiled program, one all-gather per
weight per step in the HLO, and checkpoints that resume with it switched on or off or on another
data size. Each compiled step is built once per module (tiny model, float32).
"""

from functools import lru_cache

import jax
import pytest

from jaxseq.config import OptimizerConfig, ParallelConfig, replace
from jaxseq.presets import preset
from jaxseq.models import model as M
from jaxseq.planning import hlo_collectives
from jaxseq.planning import memory
from jaxseq.training import train_step as T
from jaxseq.parallel.layout import Layout

from compiled_steps import CompiledStep

CFG = replace(preset("tiny"), dtype="float32")  # dropout 0.1: masks do not depend on the sharding
OPT = T.make_optimizer(OptimizerConfig(lr=3e-3, warmup_steps=0, decay_steps=100), CFG)
BATCH, STEPS, SAVED_AT = 16, 4, 2
# name → (data, tensor, sequence parallel, micro-batches); data=2 runs on the first 4 devices.
MESHES = {"data=4,tensor=2+sp": (4, 2, True, 4), "data=8": (8, 1, False, 1), "data=2,tensor=2+sp": (2, 2, True, 4)}
KEY = jax.random.key(1)


@lru_cache(maxsize=None)
def setup(name: str, distributed: bool) -> CompiledStep:
    """A mesh of MESHES, its state shardings and the compiled step, with or without the distributed optimizer."""
    data, tensor, sp, micro_batches = MESHES[name]
    parallel = ParallelConfig(data=data, tensor=tensor, sequence_parallel=sp, distributed_optimizer=distributed)
    return CompiledStep(CFG, parallel, OPT, micro_batches, BATCH, KEY, SAVED_AT)


@pytest.fixture(scope="module")
def straight(devices, tmp_path_factory):
    """name → {distributed: (losses of STEPS steps, checkpoint directory at step SAVED_AT)}."""
    out = {}
    for name in ("data=4,tensor=2+sp", "data=8"):
        for distributed in (False, True):
            s = setup(name, distributed)
            directory = str(tmp_path_factory.mktemp("ckpt"))
            out.setdefault(name, {})[distributed] = (s.run(s.init(), 0, STEPS, save_to=directory), directory)
    return out


def _close(a: list[float], b: list[float], rel: float):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert abs(x - y) <= rel * abs(y), (a, b)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["data=4,tensor=2+sp", "data=8"])
def test_same_losses_with_and_without(straight, name):
    """data=4 × tensor=2 + SP with 4 micro-batches (gradient accumulation), and data=8."""
    without, with_it = straight[name][False][0], straight[name][True][0]
    _close(with_it, without, 1e-6)
    assert with_it[-1] < with_it[0]  # it learns


def test_master_weights_and_moments_are_split_over_data(devices):
    s = setup("data=4,tensor=2+sp", True)
    state = s.init()
    kernel = state.params["layers"]["mlp"]["wi"]["kernel"]  # [L, h, f]: f split by tensor, h by data
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "data", "tensor")
    assert kernel.addressable_shards[0].data.shape == (CFG.layers, CFG.hidden // 4, CFG.mlp_hidden // 2)
    adam = state.opt_state[1][0]
    assert adam.mu["layers"]["mlp"]["wi"]["kernel"].sharding == kernel.sharding
    assert adam.nu["layers"]["mlp"]["wi"]["kernel"].sharding == kernel.sharding
    # [L, f/t] = [2, 128] per tensor rank: f is split by tensor and d=4 divides neither L nor nothing
    # else, so this bias stays replicated over data.
    assert state.params["layers"]["mlp"]["wi"]["bias"].sharding.spec == jax.sharding.PartitionSpec(None, "tensor")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["data=2,tensor=2+sp", "data=8"])
def test_state_bytes_per_device_are_master_plus_moments_over_d(devices, name):
    """memory_analysis() arguments: the state (fp32 master 4 + moments 8 bytes per parameter, / d),
    the batch and the key. At these shapes every leaf has a dimension d divides."""
    s = setup(name, True)
    d, t = s.parallel.data, s.parallel.tensor
    elements, _ = memory.parameter_elements_per_device(CFG, t)
    formula = 12 * elements / d
    batch_bytes = 2 * 4 * BATCH // d * CFG.seq_len
    state_args = s.compiled.memory_analysis().argument_size_in_bytes - batch_bytes
    assert abs(state_args / formula - 1) < 0.01, (state_args, formula)
    shards = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(s.init()))
    assert abs(shards / formula - 1) < 0.01, (shards, formula)
    # jaxseq.plan's figures for the same configuration agree.
    state = memory.state_bytes(CFG, t, data=d, distributed_optimizer=True)
    assert abs((state.params + state.optimizer) / shards - 1) < 0.01


@pytest.mark.slow
def test_without_it_every_data_rank_holds_everything(devices):
    s = setup("data=8", False)
    elements, _ = memory.parameter_elements_per_device(CFG, 1)
    assert abs(s.compiled.memory_analysis().argument_size_in_bytes / (12 * elements) - 1) < 0.01


def _data_all_gathers(hlo: str, data: int):
    """(result dims, inside a loop?) of every floating-point all-gather over a group of `data` devices."""
    return [(g.dims, g.in_loop) for g in hlo_collectives.all_gathers(hlo, data)]


@pytest.mark.slow
def test_each_weight_is_all_gathered_once_per_step(devices):
    """4 micro-batches, 2 scanned layers: still one all-gather over data per sharded weight, outside
    every loop, of the compute weight's per-device shape; none without the distributed optimizer."""
    s = setup("data=4,tensor=2+sp", True)
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
    shapes = jax.tree.leaves(jax.eval_shape(lambda: s.init().params))
    compute_specs = jax.tree.leaves(M.param_specs(CFG, s.parallel), is_leaf=is_spec)
    master = jax.tree.leaves(Layout(CFG, s.parallel).master_specs, is_leaf=is_spec)
    expected = sorted(
        tuple(n // (s.parallel.tensor if axis == "tensor" else 1) for n, axis in zip(x.shape, [*spec, *[None] * 8]))
        for x, spec, m in zip(shapes, compute_specs, master) if "data" in m)
    assert len(expected) == len(shapes) - 1  # all but the [L, f/t] MLP bias (see above)
    gathers = _data_all_gathers(s.compiled.as_text(), 4)
    assert not [dims for dims, in_loop in gathers if in_loop]
    assert sorted(dims for dims, _ in gathers) == expected
    assert _data_all_gathers(setup("data=4,tensor=2+sp", False).compiled.as_text(), 4) == []


@pytest.mark.slow
@pytest.mark.parametrize("saved_with", [True, False])
def test_resume_switching_it_on_or_off(straight, saved_with):
    name = "data=4,tensor=2+sp"
    directory = straight[name][saved_with][1]
    s = setup(name, not saved_with)
    _close(s.run(s.restore(directory), SAVED_AT, STEPS), straight[name][not saved_with][0][SAVED_AT:], 1e-6)


@pytest.mark.slow
def test_resume_on_another_data_size(straight):
    """Saved at data=4 × tensor=2, resumed at data=2 × tensor=2 (on 4 devices); same global batch."""
    directory = straight["data=4,tensor=2+sp"][True][1]
    s = setup("data=2,tensor=2+sp", True)
    _close(s.run(s.restore(directory), SAVED_AT, STEPS), straight["data=4,tensor=2+sp"][True][0][SAVED_AT:], 1e-6)


def test_flag_yaml_and_key_value(tmp_path):
    from jaxseq.config import ConfigError
    from jaxseq.train import build_parser, configs_from_args

    parse = lambda *argv: configs_from_args(build_parser().parse_intermixed_args(list(argv)))[0]["parallel"]
    assert parse().distributed_optimizer is False
    assert parse("--distributed-optimizer").distributed_optimizer is True
    path = tmp_path / "run.yaml"
    path.write_text("parallel: {distributed_optimizer: true}\n")
    assert parse("--config", str(path)).distributed_optimizer is True
    assert parse("--config", str(path), "distributed_optimizer=false").distributed_optimizer is False
    assert parse("--no-distributed-optimizer", "parallel.distributed_optimizer=yes").distributed_optimizer is True
    with pytest.raises(ConfigError, match="parallel.data is set with --mesh"):
        parse("parallel.data=2")
    with pytest.raises(ConfigError, match="distributed_optimizer='maybe' is not a valid bool"):
        parse("distributed_optimizer=maybe")


@pytest.mark.slow
def test_train_command_with_it_then_resumed_without_it(tmp_path):
    """The loop (evaluation and sampling read the data-sharded params too) and config.json."""
    import json
    import os

    from test_train import TINY, losses, run

    run_dir = str(tmp_path)
    out = run(*TINY, "--steps", "2", "--run-dir", run_dir, "--distributed-optimizer")
    assert "data=2 × tensor=4 + SP + distributed optimizer" in out.stdout
    assert json.load(open(os.path.join(run_dir, "config.json")))["parallel"]["distributed_optimizer"] is True
    run(*TINY, "--steps", "3", "--run-dir", run_dir, "--resume", "--no-distributed-optimizer")  # (else kept)
    assert json.load(open(os.path.join(run_dir, "config.json")))["parallel"]["distributed_optimizer"] is False
    assert sorted(losses(run_dir)) == [1, 2, 3]
