"""Orbax checkpoints: restore onto another mesh (re-padded vocabulary), fall back past a damaged step (and set it
aside when resuming), and let a bug propagate."""

import errno
import gc
import logging
import os
import shutil
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxseq.config import ConfigError, OptimizerConfig, ParallelConfig, replace
from jaxseq.presets import preset
from jaxseq.mesh import make_mesh
from jaxseq.models import model as M
from jaxseq.training import checkpoint as C
from jaxseq.training import train_step as T
from jaxseq.parallel.layout import Layout

CFG = replace(preset("tiny"), vocab_size=300, dtype="float32")  # padded to 512 rows at t=4 and t=2, 384 at t=1
OPT = T.make_optimizer(OptimizerConfig(), CFG)


def _state(parallel, devices, seed=0):
    mesh = make_mesh(parallel, devices)
    return mesh, T.init_state(jax.random.key(seed), Layout(CFG, parallel, mesh), OPT)


def _target(parallel, devices):
    mesh = make_mesh(parallel, devices)
    layout = Layout(CFG, parallel, mesh)
    abstract = jax.eval_shape(lambda: T.init_state(jax.random.key(0), layout, OPT))
    return abstract, T.state_shardings(layout, OPT), mesh


def _save(directory, step, state, meta=None):
    mgr = C.manager(directory, keep=3, async_save=True)
    C.save(mgr, step, state, meta or {"data_position": step, "config": {"model": {"layers": 2}}}, force=True)
    mgr.wait_until_finished()
    mgr.close()


def test_restore_on_another_tensor_size_repads_the_vocabulary(devices, tmp_path):
    src = ParallelConfig(data=2, tensor=4, sequence_parallel=True)
    _, state = _state(src, devices)
    _save(str(tmp_path), 3, state)
    for dst, used in ((ParallelConfig(data=4, tensor=2, sequence_parallel=True), devices),
                      (ParallelConfig(data=1, tensor=1), devices[:1])):
        abstract, shardings, mesh = _target(dst, used)
        restored, meta = C.restore(C.manager(str(tmp_path)), abstract, shardings, mesh)
        assert meta["data_position"] == 3
        rows = CFG.padded_vocab(dst.tensor)
        assert restored.params["embed"]["token"].shape[0] == rows
        assert restored.params["embed"]["token"].sharding == shardings.params["embed"]["token"]
        # The real vocabulary rows and every other leaf are equal; only padding changed.
        np.testing.assert_array_equal(np.asarray(restored.params["embed"]["token"])[: CFG.vocab_size],
                                      np.asarray(state.params["embed"]["token"])[: CFG.vocab_size])
        for a, b in zip(jax.tree.leaves(restored.params["layers"]), jax.tree.leaves(state.params["layers"])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert int(restored.step) == int(state.step)


def _files(step_dir, *parts):
    """The files under one directory of a checkpoint step."""
    return [os.path.join(root, f) for root, _, files in os.walk(os.path.join(step_dir, *parts)) for f in files]


# How a checkpoint step gets damaged, and what orbax raises reading it (each a different path through restore).
DAMAGE = {
    "meta JSON cut short": lambda d: open(os.path.join(d, "meta", "metadata"), "w").write('{"data_posi'),  # ValueError
    "meta item gone": lambda d: shutil.rmtree(os.path.join(d, "meta")),  # KeyError
    "state item gone": lambda d: shutil.rmtree(os.path.join(d, "state")),  # KeyError
    "state metadata gone": lambda d: [os.remove(os.path.join(d, "state", f)) for f in ("_METADATA", "_sharding")],
    # the arrays' data: orbax raises a bare Exception whose cause is TensorStore's ValueError
    "array data gone": lambda d: [os.remove(f) for f in _files(d, "state") if os.sep + "d" + os.sep in f],
}


@pytest.fixture(scope="module")
def two_states(devices):
    parallel = ParallelConfig(data=2, tensor=4, sequence_parallel=True)
    return parallel, _state(parallel, devices, seed=1)[1], _state(parallel, devices, seed=2)[1]


@pytest.mark.parametrize("damage", DAMAGE)
# A failed array read leaves orbax's other read coroutines to a closed event loop ("Exception ignored").
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_unreadable_latest_falls_back_to_the_previous(devices, tmp_path, caplog, two_states, damage):
    parallel, first, second = two_states
    _save(str(tmp_path), 1, first)
    _save(str(tmp_path), 2, second)
    DAMAGE[damage](os.path.join(tmp_path, "2"))
    abstract, shardings, mesh = _target(parallel, devices)
    with caplog.at_level(logging.WARNING, logger="jaxseq"):
        restored, meta = C.restore(C.manager(str(tmp_path)), abstract, shardings, mesh)
    assert meta["data_position"] == 1
    assert "checkpoint step 2 is unreadable" in caplog.text
    np.testing.assert_array_equal(np.asarray(restored.params["embed"]["token"]),
                                  np.asarray(first.params["embed"]["token"]))
    assert C.manager(str(tmp_path)).all_steps() == [1, 2]  # a reader (generate, convert) moves nothing


@pytest.mark.parametrize("bug", [TypeError, AttributeError, ValueError])
def test_a_bug_in_restore_propagates(devices, tmp_path, monkeypatch, two_states, bug):
    """A code bug while restoring (here in the sharding of the target) is not a damaged checkpoint: it
    is raised, not taken as a reason to fall back to an older step."""
    parallel, first, second = two_states
    _save(str(tmp_path), 1, first)
    _save(str(tmp_path), 2, second)

    def buggy(*args):
        raise bug("a bug")

    monkeypatch.setattr(C, "restorable", buggy)
    abstract, shardings, mesh = _target(parallel, devices)
    with pytest.raises(bug, match="a bug"):
        C.restore(C.manager(str(tmp_path)), abstract, shardings, mesh)


def test_no_readable_step_is_one_line_naming_each(devices, tmp_path, two_states):
    parallel, first, second = two_states
    _save(str(tmp_path), 1, first)
    _save(str(tmp_path), 2, second)
    DAMAGE["meta JSON cut short"](os.path.join(tmp_path, "1"))
    DAMAGE["state item gone"](os.path.join(tmp_path, "2"))
    abstract, shardings, mesh = _target(parallel, devices)
    with pytest.raises(ConfigError) as e:
        C.restore(C.manager(str(tmp_path)), abstract, shardings, mesh, set_aside=True)
    line = str(e.value)
    assert line.startswith(f"no readable checkpoint in {tmp_path}: checkpoint step 2 is unreadable (KeyError")
    assert "checkpoint step 1 is unreadable (JSONDecodeError" in line and "\n" not in line
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]  # nothing restored, nothing set aside


def test_a_transient_io_error_is_retried_and_sets_nothing_aside(devices, tmp_path, caplog, monkeypatch, two_states):
    """EIO on a network filesystem (or EMFILE, a timeout) says nothing about the checkpoint: the newest step is read
    again and restored, and nothing is set aside; an error that does not pass is one line, the step left in place.
    Before, any OSError was damage: a resume set the good newest step aside and rolled the run back to step 1."""
    parallel, first, second = two_states
    _save(str(tmp_path), 1, first)
    _save(str(tmp_path), 2, second)
    abstract, shardings, mesh = _target(parallel, devices)
    monkeypatch.setattr(C, "RETRY_WAITS", (0.0, 0.0, 0.0), raising=False)  # no waits in a test
    for failures in (2, 4):  # each read of step 2 fails this many times, then reads
        mgr, failed = C.manager(str(tmp_path)), []
        real_restore = mgr.restore

        def flaky(step, *args, **kwargs):
            if step == 2 and len(failed) < failures:
                failed.append(step)
                raise OSError(errno.EIO, "Input/output error")
            return real_restore(step, *args, **kwargs)

        monkeypatch.setattr(mgr, "restore", flaky)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="jaxseq"):
            if failures < 4:
                restored, meta = C.restore(mgr, abstract, shardings, mesh, set_aside=True)
                assert meta["data_position"] == 2
                np.testing.assert_array_equal(np.asarray(restored.params["embed"]["token"]),
                                              np.asarray(second.params["embed"]["token"]))
            else:
                with pytest.raises(ConfigError) as e:
                    C.restore(mgr, abstract, shardings, mesh, set_aside=True)
                assert str(e.value) == ("checkpoint step 2 could not be read (OSError: [Errno 5] Input/output error), "
                                        "4 times; the checkpoint is left as it is (an I/O error, not a damaged "
                                        "checkpoint): try again once its filesystem answers")
        assert sorted(os.listdir(tmp_path)) == ["1", "2"]  # nothing set aside
        assert [r.getMessage() for r in caplog.records] == [
            "checkpoint step 2 could not be read (OSError: [Errno 5] Input/output error); trying again in 0 s"] * min(
                failures, 3)


@pytest.mark.slow
def test_a_resume_past_a_damaged_step_sets_it_aside_and_saves_it_again(tmp_path, caplog):
    """As a user meets it: a run checkpointed at steps 2 and 4 whose step-4 metadata is damaged. The
    resume warns, sets step 4 aside (one line says where), resumes from step 2, trains on and saves
    step 4 again (orbax refused it while the damaged one was there: StepAlreadyExistsError, and every
    later --resume fell back the same way); a second resume continues from the newest step."""
    from test_train import TINY, metrics, run

    run_dir = str(tmp_path / "run")
    checkpoints = os.path.join(run_dir, "checkpoints")
    run(*TINY, "--steps", "4", "--checkpoint-every", "2", "--run-dir", run_dir)
    assert sorted(os.listdir(checkpoints)) == ["2", "4"]
    DAMAGE["meta JSON cut short"](os.path.join(checkpoints, "4"))
    with caplog.at_level(logging.WARNING, logger="jaxseq"):
        run(*TINY, "--steps", "6", "--checkpoint-every", "2", "--run-dir", run_dir, "--resume")
    aside = os.path.join(os.path.abspath(checkpoints), "unreadable", "4")
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]  # one, nothing else
    assert len(lines) == 1 and lines[0].startswith(f"checkpoint step 4 set aside in {aside} "
                                                   "(unreadable: JSONDecodeError: ")
    assert lines[0].endswith("; the run resumes from step 2)")
    assert os.path.isdir(aside)
    assert sorted(os.listdir(checkpoints)) == ["2", "4", "6", "unreadable"]
    assert [r["step"] for r in metrics(run_dir)][-4:] == [3, 4, 5, 6]  # the steps after 2, again
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxseq"):
        run(*TINY, "--steps", "7", "--checkpoint-every", "2", "--run-dir", run_dir, "--resume")
    assert "unreadable" not in caplog.text
    assert [r["step"] for r in metrics(run_dir)][-1:] == [7]
    assert sorted(os.listdir(checkpoints)) == ["4", "6", "7", "unreadable"]  # the newest 3 kept


def test_a_failed_array_read_is_one_warning_line_and_no_traceback(devices, tmp_path, caplog, monkeypatch, two_states):
    """The newest step's array data emptied: when one read fails orbax closes its event loop under the others, whose
    late completions raised RuntimeError('Event loop is closed') into sys.unraisablehook (46 tracebacks in a
    tiny run) and were logged by asyncio ("Future exception was never retrieved"), under the warning. Now one
    warning line, nothing else."""
    parallel, first, second = two_states
    _save(str(tmp_path), 1, first)
    _save(str(tmp_path), 2, second)
    for path in _files(os.path.join(tmp_path, "2"), "state", "d"):  # the OCDBT root's data emptied
        open(path, "w").close()
    abstract, shardings, mesh = _target(parallel, devices)
    # Listen only from here: an earlier test's abandoned reads (another damaged checkpoint, in this process) may
    # still be completing, and a hook replaced by this test no longer drops theirs.
    gc.collect()
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with caplog.at_level(logging.WARNING):
        _, meta = C.restore(C.manager(str(tmp_path)), abstract, shardings, mesh)
        time.sleep(0.5)  # the abandoned reads finish
        gc.collect()  # and their futures go (asyncio logs an unretrieved exception then)
    assert meta["data_position"] == 1
    assert [str(u.exc_value) for u in unraisable] == []
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("checkpoint step 2 is unreadable (ValueError: "), lines
    assert lines[0].endswith("; restored step 1 instead")


def test_asyncio_unretrieved_reads_are_dropped_futures_and_tasks_alike(caplog):
    """asyncio names an unawaited failed read "Future exception …" or, for a task, "Task exception …" (CI's run
    logged the second under the warning line); both are dropped when a damaged read raised, anything else is kept."""
    C._drop_abandoned_reads()
    damaged = ValueError("OUT_OF_RANGE: Error reading byte range")
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        for kind in ("Future", "Task"):
            logging.getLogger("asyncio").error(f"{kind} exception was never retrieved",
                                               exc_info=(ValueError, damaged, None))
        logging.getLogger("asyncio").error("Task exception was never retrieved",
                                           exc_info=(TypeError, TypeError(), None))
    assert [r.exc_info[0] for r in caplog.records] == [TypeError]


def test_incompatible_model_is_refused():
    C.check_compatible({"layers": 2, "dropout": 0.1}, {"layers": 2, "dropout": 0.0})  # dropout may change
    with pytest.raises(ConfigError, match=r"cannot resume: .*layers=2 \(saved\) vs 3"):
        C.check_compatible({"layers": 2, "hidden": 64}, {"layers": 3, "hidden": 64})


def _abstract_params(cfg, parallel, devices):
    mesh = make_mesh(parallel, devices)
    return jax.tree.map(lambda shape, spec: jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, spec)),
                        M.param_shapes(cfg, parallel.tensor), M.param_specs(cfg, parallel),
                        is_leaf=lambda x: isinstance(x, tuple))


def test_restore_params_reads_the_params_alone_onto_another_mesh(devices, tmp_path):
    """Saved on data=2 × tensor=4 (512 vocabulary rows), read onto tensor=8 (1024 rows: zeros past the saved
    ones) and onto one device (384 rows: cut), with 16 of the 64 positions; a shape the model does not have
    (other layers, more positions than saved) is refused in one line before anything is read."""
    _, state = _state(ParallelConfig(data=2, tensor=4, sequence_parallel=True), devices)
    _save(str(tmp_path), 3, state)
    mgr = C.reader(str(tmp_path))
    saved_token = np.asarray(state.params["embed"]["token"])
    for parallel, used in ((ParallelConfig(tensor=8), devices), (ParallelConfig(), devices[:1])):
        params = C.restore_params(mgr, 3, _abstract_params(replace(CFG, seq_len=16), parallel, used))
        token = np.asarray(params["embed"]["token"])
        rows = min(len(token), len(saved_token))
        np.testing.assert_array_equal(token[:rows], saved_token[:rows])
        assert not token[rows:].any() and len(token) == CFG.padded_vocab(parallel.tensor)
        np.testing.assert_array_equal(np.asarray(params["embed"]["position"]),
                                      np.asarray(state.params["embed"]["position"])[:16])
        for a, b in zip(jax.tree.leaves(params["layers"]), jax.tree.leaves(state.params["layers"])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for other, named in ((replace(CFG, layers=4),
                          r"layers\.attn\.k\.bias has shape \(2, 8, 8\), the model needs \(4, 8, 8\)"),
                         (replace(CFG, seq_len=128),
                          r"embed\.position has shape \(64, 64\), the model needs \(128, 64\)")):
        with pytest.raises(ConfigError, match=named):
            C.restore_params(mgr, 3, _abstract_params(other, ParallelConfig(), devices[:1]))


def test_a_damaged_checkpoint_is_one_line_naming_an_earlier_one(devices, tmp_path):
    """generate and convert read the newest checkpoint: a damaged one stops them in one line that names it and
    the earlier step to pass instead (RUN/checkpoints/N)."""
    from jaxseq.config import RunConfig, TrainConfig
    from jaxseq.training import rundir

    parallel = ParallelConfig(data=2, tensor=4)
    _, state = _state(parallel, devices)
    run = RunConfig(model=CFG, parallel=parallel, optimizer=OptimizerConfig(), train=TrainConfig(run_dir=str(tmp_path)))
    rundir.write_config(str(tmp_path), run)
    for step in (2, 4):
        _save(rundir.checkpoint_dir(str(tmp_path)), step, state)
    shutil.rmtree(tmp_path / "checkpoints" / "4" / "state" / "d")  # the newest one's array data
    mesh = make_mesh(parallel, devices)
    with pytest.raises(ConfigError,
                       match=r"checkpoint step 4 of .* is unreadable \(.*\); an earlier one: .*checkpoints/2$"):
        rundir.restore(str(tmp_path), parallel, mesh)
    assert rundir.restore(str(tmp_path / "checkpoints" / "2"), parallel, mesh).step == 2


def _saved(run_dir, step):
    """Every array of a checkpoint as written (state: params, Adam moments, step; meta), on the host."""
    import orbax.checkpoint as ocp

    path = os.path.join(run_dir, "checkpoints", str(step))
    state = ocp.StandardCheckpointer().restore(os.path.join(path, "state"))
    meta = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(os.path.join(path, "meta"))
    return jax.tree.map(np.asarray, state), meta


@pytest.mark.slow
def test_a_checkpoint_written_mid_run_equals_a_run_stopped_there(tmp_path):
    """A checkpoint saved asynchronously while the next (donated) steps run holds the state of that
    step, not of a later one: every array of checkpoint 4 of a 6-step run (checkpoints at 2, 4, 6)
    equals the final checkpoint of a 4-step run, bit for bit. (That a restored state continues with
    the same losses is test_train.py's resume test.)"""
    from test_train import TINY, run

    mid, stopped = str(tmp_path / "mid"), str(tmp_path / "stopped")
    run(*TINY, "--steps", "6", "--checkpoint-every", "2", "--run-dir", mid)
    # The same learning-rate schedule (its length defaults to --steps), stopped after step 4.
    run(*TINY, "--steps", "4", "--checkpoint-every", "100", "--run-dir", stopped, "decay_steps=6")
    assert sorted(os.listdir(os.path.join(mid, "checkpoints"))) == ["2", "4", "6"]
    assert sorted(os.listdir(os.path.join(stopped, "checkpoints"))) == ["4"]
    (state, meta), (ref_state, ref_meta) = _saved(mid, 4), _saved(stopped, 4)
    assert meta["data_position"] == ref_meta["data_position"]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(ref_state)]
    assert [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)] == paths
    assert any("mu" in p for p in paths) and any("nu" in p for p in paths)  # the Adam moments are compared too
    for path, a, b in zip(paths, jax.tree.leaves(state), jax.tree.leaves(ref_state)):
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    assert int(state["step"]) == 4
    # A later checkpoint differs (the comparison would catch a save that read the next step's buffers).
    later, _ = _saved(mid, 6)
    assert not np.array_equal(later["params"]["embed"]["token"], state["params"]["embed"]["token"])

