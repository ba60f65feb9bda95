"""Orbax checkpoints of the train state: asynchronous, atomic, keep-last-N, restorable on any mesh.

A checkpoint holds the sharded TrainState and a small JSON item (`meta`): the data position and the
resolved configuration, so a resume continues the same data stream and refuses a different model.
A resume restores the whole state (`restore`); sampling, conversion and `--init-from` read the params
alone, shard by shard (`reader`, `restore_params`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxseq.config import ARCHITECTURE_FIELDS, ConfigError
from jaxseq.models.model import position_paths, saved_model_fields, vocab_paths
from jaxseq.parallel.layout import restorable

log = logging.getLogger("jaxseq")

# What reading a torn, truncated or missing checkpoint raises (orbax 0.12.8, each tried): a file or an item
# that is not there (FileNotFoundError, KeyError), JSON or TensorStore data that does not parse (ValueError, of
# which json.JSONDecodeError); orbax wraps a failed array read in a bare Exception caused by one of these.
DAMAGED = (FileNotFoundError, NotADirectoryError, ValueError, KeyError)
# Any other OSError says nothing about the checkpoint (EIO on a network filesystem, EMFILE, a timeout, a
# permission): the step is read again after each of these waits (seconds), then the read fails in one line and the
# step stays where it is. Set aside, a good newest step would roll the run back.
RETRY_WAITS = (0.5, 2.0, 5.0)
UNREADABLE = (OSError, ValueError, KeyError)  # DAMAGED, or an I/O error to retry
SET_ASIDE = "unreadable"  # DIR/unreadable/STEP: where a resume moves the steps it could not read


def manager(directory: str, keep: int = 3, async_save: bool = True) -> ocp.CheckpointManager:
    """Orbax writes each step to a temporary directory and renames it when complete: atomic."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(os.path.abspath(directory), options=options, item_handlers=handlers)


def save(mgr: ocp.CheckpointManager, step: int, state, meta: dict, force: bool = False) -> bool:
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
    return mgr.save(step, args=args, force=force)


def _names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def _vocab_rows(params) -> int:
    """Rows of the parameters' vocabulary leaves (the vocabulary is padded per tensor size)."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    return next(x.shape[0] for path, x in leaves if _names(path) in vocab_paths())


def _params_like(x) -> bool:
    return isinstance(x, dict) and "layers" in x and "embed" in x


def _map_vocab_leaves(fn, tree):
    """`tree` with fn(leaf) at every vocabulary leaf (`vocab_paths`) of each parameter-shaped subtree:
    the params themselves and each Adam moment."""
    vocab = vocab_paths()
    at = lambda params: jax.tree_util.tree_map_with_path(lambda path, x: fn(x) if _names(path) in vocab else x, params)
    return jax.tree.map(lambda x: at(x) if _params_like(x) else x, tree, is_leaf=_params_like)


def _abstract(state_shardings, shapes_like):
    return jax.tree.map(lambda sh, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state_shardings, shapes_like)


def resize_vocab(tree, rows: int, shardings):
    """Pad (zeros) or cut every [vocab, h] leaf of a state or parameter tree (the embedding and its
    Adam moments) to `rows`, placed on `shardings`. Rows past the real vocabulary are never used
    (their logits are masked), so this loses nothing."""

    def resize(x):
        # A pad, not zeros().at[].set(): XLA partitions a pad between shardings, where it replicated the
        # scatter's whole table on every device ("involuntary full rematerialization").
        return jnp.pad(x[:rows], ((0, max(rows - x.shape[0], 0)),) + ((0, 0),) * (x.ndim - 1))

    return jax.jit(lambda t: _map_vocab_leaves(resize, t), out_shardings=shardings)(tree)


def restore(mgr: ocp.CheckpointManager, abstract_state, state_shardings, mesh, check=None,
            set_aside: bool = False):
    """Restore the newest readable checkpoint onto `state_shardings` (any mesh).

    Returns (state, meta), or None when there is no checkpoint. `check(meta)` runs before the state is
    read (to refuse an incompatible model with a clear error). A step that fails to read as a torn or
    missing checkpoint does is skipped and the previous one is tried; once one restores, one warning line
    per skipped step says so, and `set_aside` moves the skipped ones out of the way (`set_aside_steps`), so
    that a resumed run can save those steps again. A step whose read fails with another I/O error is read again
    (`retried`), then refused in one line, never skipped: a good newest step set aside would roll the run back.
    Any other exception is a bug and propagates; no readable step at all is a ConfigError naming each failure.
    """
    skipped = []
    for step in sorted(mgr.all_steps(), reverse=True):
        try:
            state, meta, rows = retried(lambda: _restore_step(mgr, step, abstract_state, state_shardings, mesh, check),
                                        step)
        except UnreadableStep as e:
            skipped.append(e)
            continue
        if set_aside and skipped:
            set_aside_steps(mgr, skipped, step)
        for e in [] if set_aside else skipped:  # one line each, set aside or not
            log.warning("%s; restored step %d instead", e, step)
        wanted = _vocab_rows(abstract_state.params)
        if rows != wanted:
            state = resize_vocab(state, wanted, state_shardings)
        return state, meta
    if skipped:
        raise ConfigError(f"no readable checkpoint in {mgr.directory}: " + "; ".join(map(str, skipped)))
    return None


def _restore_step(mgr: ocp.CheckpointManager, step: int, abstract_state, state_shardings, mesh, check):
    """(state, meta, the saved vocabulary rows) of checkpoint `step` (`restore`)."""
    with _reading(step):
        meta = dict(mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
    if check is not None:
        check(meta)
    with _reading(step):
        saved = mgr.item_metadata(step)["state"]
        if saved is None:  # its metadata files are gone
            raise FileNotFoundError("the state's metadata is missing")
    rows = _vocab_rows(saved["params"])
    shapes = _map_vocab_leaves(lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype), abstract_state)
    shardings = jax.tree.map(lambda sh, x: restorable(sh, x.shape, mesh), state_shardings, shapes)
    with _reading(step):
        state = mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_abstract(shardings, shapes))))["state"]
    return state, meta, rows


def retried(read, step: int):
    """read(), tried again after each of RETRY_WAITS while it fails with an I/O error that is no damage
    (`_reading`); then one line, the step left as it is."""
    for wait in RETRY_WAITS:
        try:
            return read()
        except FailedRead as e:
            log.warning("%s; trying again in %g s", e, wait)
            time.sleep(wait)
    try:
        return read()
    except FailedRead as e:
        raise ConfigError(f"{e}, {len(RETRY_WAITS) + 1} times; the checkpoint is left as it is (an I/O error, not "
                          "a damaged checkpoint): try again once its filesystem answers") from None


def reader(directory: str) -> ocp.CheckpointManager:
    """A manager for reading, whose state item is read as a plain PyTree, so that a part of it (the params,
    without the Adam moments) can be restored alone (orbax's `partial_restore`)."""
    options = ocp.CheckpointManagerOptions(create=False)
    handlers = {"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(os.path.abspath(directory), options=options, item_handlers=handlers)


def restore_params(mgr: ocp.CheckpointManager, step: int, abstract_params):
    """The params of checkpoint `step` read straight into `abstract_params` (ShapeDtypeStructs with
    shardings, any mesh, any dtype): each device reads only its own slices, nothing else is read.

    The vocabulary leaves are padded with zeros or cut to the rows asked for, and the position table may be
    cut to a shorter seq_len (orbax's non-strict restore); any other difference of shape is refused first,
    in one line, so nothing changes shape silently. A torn or missing checkpoint raises UnreadableStep; another
    I/O error is retried (`retried`)."""
    return retried(lambda: _restore_params(mgr, step, abstract_params), step)


def _restore_params(mgr: ocp.CheckpointManager, step: int, abstract_params):
    with _reading(step):
        saved = mgr.item_metadata(step)["state"]
        if saved is None:  # its metadata files are gone
            raise FileNotFoundError("the state's metadata is missing")
    _check_shapes(saved["params"], abstract_params, step)
    target = {"params": abstract_params}
    args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype,
                                                       strict=False), target)
    with _reading(step):
        restored = mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item=target, restore_args=args, partial_restore=True)))
    return restored["state"]["params"]


def _check_shapes(saved, abstract_params, step: int) -> None:
    leaves = jax.tree_util.tree_leaves_with_path(abstract_params)
    for (path, want), got in zip(leaves, jax.tree.leaves(saved)):
        vocab, position = _names(path) in vocab_paths(), _names(path) in position_paths()
        got, want = tuple(got.shape), tuple(want.shape)
        rows_ok = vocab or (position and want[0] <= got[0]) or want[0] == got[0]
        if not rows_ok or got[1:] != want[1:]:
            raise ConfigError(f"checkpoint step {step}: {jax.tree_util.keystr(path, simple=True, separator='.')} has "
                              f"shape {got}, the model needs {want}")


def _detail(cause: BaseException) -> str:
    first = str(cause).strip().splitlines()[0][:200] if str(cause).strip() else ""
    return f"{type(cause).__name__}: {first}"


class UnreadableStep(Exception):
    """Reading checkpoint `step` failed as a torn, truncated or missing checkpoint fails."""

    def __init__(self, step: int, cause: BaseException):
        self.step, self.detail = step, _detail(cause)
        super().__init__(f"checkpoint step {step} is unreadable ({self.detail})")


class FailedRead(Exception):
    """Reading checkpoint `step` failed with an I/O error that says nothing about the checkpoint (`retried`)."""

    def __init__(self, step: int, cause: BaseException):
        self.step, self.detail = step, _detail(cause)
        super().__init__(f"checkpoint step {step} could not be read ({self.detail})")


@contextlib.contextmanager
def _reading(step: int):
    """Around orbax's reads only: what a damaged checkpoint raises becomes UnreadableStep, another I/O error
    FailedRead; a bug propagates. The abandoned reads' noise is dropped from before the first read: they can
    complete before the failure reaches here."""
    _drop_abandoned_reads()
    try:
        yield
    except Exception as e:
        cause = e
        while cause is not None and not isinstance(cause, UNREADABLE):
            cause = cause.__cause__
        if cause is None:
            raise
        raise (UnreadableStep if isinstance(cause, DAMAGED) else FailedRead)(step, cause) from e


def _closed_loop(unraisable) -> bool:
    return isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"


def _not_an_unretrieved_read(record: logging.LogRecord) -> bool:
    """asyncio logs an unawaited failed future as "Future exception …", a failed task as "Task exception …"."""
    unretrieved = record.getMessage().startswith(tuple(f"{kind} exception was never retrieved"
                                                       for kind in ("Future", "Task")))
    return not (unretrieved and record.exc_info is not None and isinstance(record.exc_info[1], UNREADABLE))


def _drop_abandoned_reads() -> None:
    """After a failed read orbax closes its asyncio loop under the reads still in flight: each of their late
    completions raises RuntimeError('Event loop is closed') into sys.unraisablehook, and each failed one is
    logged by asyncio as a "Future (or Task) exception was never retrieved" — pages of tracebacks after the one line
    that says the step is unreadable. Those are dropped (installed once, before a read); anything else still
    reaches the hook that was there and the log."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_abandoned_reads", False):
        return

    def hook(unraisable):
        if not _closed_loop(unraisable):
            previous(unraisable)

    hook.drops_abandoned_reads = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_not_an_unretrieved_read)  # once: addFilter skips one it holds


def set_aside_steps(mgr: ocp.CheckpointManager, unreadable: list[UnreadableStep], restored: int) -> None:
    """Move unreadable steps to DIR/unreadable/STEP (one line each says why and where) and forget them: left
    in place, the run that resumed from `restored` could not save those steps again (orbax refuses a step
    that exists), and every later resume would fall back the same way. Process 0 moves; all wait."""
    steps = [e.step for e in unreadable]
    if jax.process_index() == 0:
        for step, e in zip(steps, unreadable):
            source = os.path.join(str(mgr.directory), str(step))
            target = os.path.join(str(mgr.directory), SET_ASIDE, str(step))
            suffix = 1
            while os.path.exists(target):  # set aside before: keep both
                suffix += 1
                target = os.path.join(str(mgr.directory), SET_ASIDE, f"{step}-{suffix}")
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.replace(source, target)
            log.warning("checkpoint step %d set aside in %s (unreadable: %s; the run resumes from step %d)",
                        step, target, e.detail, restored)
    ocp.multihost.sync_global_processes(f"jaxseq-set-aside-{'-'.join(map(str, steps))}")
    mgr.reload()


def check_compatible(saved_model: dict, model: dict) -> None:
    """A resume must train the same model: every architecture field equal."""
    saved_model = saved_model_fields(saved_model)
    diffs = [f"{k}={saved_model.get(k)!r} (saved) vs {v!r}" for k, v in model.items()
             if k in ARCHITECTURE_FIELDS and saved_model.get(k) != v]
    if diffs:
        raise ConfigError("cannot resume: the checkpoint's model differs: " + ", ".join(diffs))
