"""The training loop: the jit-compiled step over the data, evaluation, metrics, checkpoints, signals."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh
from tqdm import tqdm

from jaxseq import offload as host_offload
from jaxseq.config import ConfigError, OptimizerConfig, ParallelConfig, RunConfig
from jaxseq.mesh import available_devices, make_mesh
from jaxseq.models import model
from jaxseq.parallel import distributed
from jaxseq.parallel.data_parallel import accumulated_loss
from jaxseq.parallel.layout import Layout, held, on_device
from jaxseq.parallel.pipeline import pipeline_loss
from jaxseq.parallel.schedule import Schedule
from jaxseq.training import aot, goodput, profile, rundir
from jaxseq.training import checkpoint
from jaxseq.training.data import Batches, Corpus, decode_tokens, printable, unigram_entropy
from jaxseq.training.metrics import MetricsLog, memory_gib, peak_tflops, throughput
from jaxseq.training.sampling import Sampler, compile_sampler, prompt_ids, sample, validation_prompt
from jaxseq.training import train_step

log = logging.getLogger("jaxseq")


class TrainingError(RuntimeError):
    """The run cannot go on (a non-finite loss); the message is one line."""


def make_eval_fn(layout: Layout, micro_batches: int):
    """jit(params, batch) → the mean loss (no dropout) of the state's params as they are stored (master
    weights, split over data by the distributed optimizer), over the batch split into `micro_batches` as the
    train step splits it: its activations are one micro-batch's. With a pipeline, forward only through the
    stages (`pipeline.pipeline_loss`), each holding only its layers; without, the model's loss of each
    micro-batch in turn on the compute copy the train step makes."""
    if layout.parallel.pipe > 1:
        loss = partial(pipeline_loss, layout=layout, microbatches=micro_batches)
    else:
        loss = partial(accumulated_loss, layout=layout, micro_batches=micro_batches)
    return jax.jit(lambda params, batch: loss(on_device(params), batch),
                   in_shardings=(held(layout.master_shardings, layout.parallel.offload_optimizer), layout.batch),
                   out_shardings=layout.replicated)


def _global(batch: dict, layout: Layout, batch_size: int) -> dict:
    return distributed.global_batch(batch, layout.batch["inputs"], batch_size)


def evaluate(eval_fn, params, batches: Batches, n: int, layout: Layout, rows: slice) -> float:
    losses = [float(eval_fn(params, _global(batches.rows(i, rows), layout, batches.batch_size))) for i in range(n)]
    return float(np.mean(losses))


class StopFlag:
    """SIGTERM / SIGINT ask the run to checkpoint and exit.

    The checkpoint save is collective, so every process must stop after the same step, whichever
    process the signal reached and at whichever step. After each step every process adds its flag
    (the signal's number, 0 for none) to a max over all devices, and acts on the max of the step
    before: by the time it is read, the next step is already queued, so the check never makes the
    host wait for an idle device (docs/DESIGN.md). The handlers are the run's only (`with StopFlag(…)`):
    the ones installed before are put back when it ends, normally or by an exception."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, layout: Layout):
        self.local = 0
        self._previous = {}
        self._size = layout.mesh.size
        self._sharding = layout.per_device  # one flag per device
        self._local_devices = len(self._sharding.addressable_devices)
        self._pending = None
        # One process agrees with itself: no program, and no collective beside every step.
        self._max = None
        if jax.process_count() > 1:  # compiled here, not at the first step: nothing compiles between train steps
            flags = jax.ShapeDtypeStruct((self._size,), jnp.int32, sharding=self._sharding)
            self._max = jax.jit(jnp.max, out_shardings=layout.replicated).lower(flags).compile()

    def __enter__(self) -> "StopFlag":
        self._previous = {sig: signal.signal(sig, self._set) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            # None: a handler not installed from Python, which Python cannot put back; the default is nearest.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def _set(self, signum, frame):
        self.local = self.local or signum

    def _agree(self) -> jax.Array | int:
        """The max of every process's flag, dispatched (not read); this process's flag where it is the only one."""
        if self._max is None:
            return self.local
        flags = np.full((self._local_devices,), self.local, np.int32)
        return self._max(jax.make_array_from_process_local_data(self._sharding, flags, (self._size,)))

    def after_step(self) -> str | None:
        """Called by every process once after dispatching each step (or drawing each sampled token): the signal
        all processes agreed on one call earlier (its name), or None."""
        previous, self._pending = self._pending, self._agree()
        agreed = 0 if previous is None else int(previous)
        return signal.Signals(agreed).name if agreed else None

    def now(self) -> str | None:
        """The signal all processes agree on now (its name), or None; waits for the answer. For after the last
        step (the closing evaluation and sample), where no step is queued to keep the device busy; every
        process calls it the same number of times."""
        agreed = int(self._agree())
        return signal.Signals(agreed).name if agreed else None


def non_finite(step: int, loss: float, grad_norm: float, last_good: int | None) -> str | None:
    """The error for a step whose loss or gradient norm is not finite, else None. Checked before the
    step's state can be checkpointed: non-finite gradients under a finite loss would otherwise be
    applied and saved as the "last good" state."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return None
    what = "loss" if not math.isfinite(loss) else "gradient norm"
    where = f"step {last_good}" if last_good is not None else "none written"
    return (f"non-finite {what} at step {step} (loss {loss}, grad_norm {grad_norm}); "
            f"the last good checkpoint is kept ({where})")


def fetch_metrics(pending: list) -> list[tuple[int, tuple[float, float]]]:
    """(step, (loss, grad_norm)) on the host for every pending step, in one device→host transfer."""
    values = jax.device_get([out for _, out in pending])
    return [(step, (float(v["loss"]), float(v["grad_norm"]))) for (step, _), v in zip(pending, values)]


def host_learning_rate(opt: OptimizerConfig):
    """step → learning rate (a float) for the log, computed on the host CPU and compiled before the
    first step: an eager call on the accelerator would queue behind the running step and block the
    log on it, and the first call's compilation would idle the device."""
    cpu = jax.local_devices(backend="cpu")[0]
    fn = jax.jit(train_step.learning_rate_schedule(opt))

    def at(step: int) -> float:
        return float(fn(jax.device_put(np.int32(step), cpu)))

    at(0)
    return at


@dataclass(frozen=True, kw_only=True)
class Session:
    """What a run trains with, built once from its configuration (`set_up`)."""

    run: RunConfig
    devices: list
    mesh: Mesh
    layout: Layout  # the model, its parallel configuration and the mesh: every sharding the run's arrays take
    optimizer: optax.GradientTransformation
    micro_batches: int
    step_fn: Callable  # jit(step)(state, batch, key) → (state, metrics), compiled by `compile_step`
    eval_fn: Callable  # jit(params, batch) → loss (`make_eval_fn`), compiled by `compile_step`
    sampler: Sampler | None  # the end-of-run sample's programs, compiled by `compile_step` (None: no sample)
    key: jax.Array  # the dropout key of every step
    rows: slice  # this process's rows of each global batch
    train_batches: Batches
    val_batches: Batches
    checkpoints: ocp.CheckpointManager
    checkpoint_dir: str

    def batch(self, position: int) -> dict:
        return _global(self.train_batches.rows(position, self.rows), self.layout, self.run.train.batch_size)

    def evaluate(self, params) -> float:
        return evaluate(self.eval_fn, params, self.val_batches, self.run.train.eval_batches, self.layout, self.rows)

    def save(self, step: int, state, position: int) -> None:
        checkpoint.save(self.checkpoints, step, state, rundir.checkpoint_meta(self.run, position), force=True)


def set_up(run: RunConfig, corpus: Corpus) -> Session:
    settings = run.train
    devices = available_devices()
    mesh = make_mesh(run.parallel, devices)
    layout = Layout(run.model, run.parallel, mesh)
    optimizer = train_step.make_optimizer(run.optimizer, run.model)
    micro = (settings.batch_size // settings.micro_batch_size) if settings.micro_batch_size else 1
    checkpoint_dir = rundir.checkpoint_dir(settings.run_dir)
    return Session(
        run=run, devices=devices, mesh=mesh, layout=layout, optimizer=optimizer, micro_batches=micro,
        step_fn=train_step.make_train_step(layout, settings.remat, optimizer, micro_batches=micro,
                                           offload=host_offload.parse(settings.offload)),
        eval_fn=make_eval_fn(layout, micro), sampler=None, key=jax.random.key(settings.seed + 1),
        rows=distributed.local_batch_rows(layout.batch["inputs"], settings.batch_size, run.model.seq_len),
        train_batches=Batches(corpus.train, run.model.seq_len, settings.batch_size, settings.seed),
        val_batches=Batches(corpus.val, run.model.seq_len, settings.batch_size, settings.seed + 1),
        checkpoints=checkpoint.manager(checkpoint_dir, keep=settings.keep_checkpoints), checkpoint_dir=checkpoint_dir)


def initial_state(session: Session) -> tuple[train_step.TrainState, int]:
    """The state to start from and its data position: the newest checkpoint (--resume), else the
    weights of --init-from or a fresh initialisation at position 0."""
    settings, layout, optimizer = session.run.train, session.layout, session.optimizer
    if settings.resume:
        return _resumed_state(session)
    if session.checkpoints.all_steps():
        raise ConfigError(f"run_dir={settings.run_dir!r} already holds checkpoints; pass --resume or another --run-dir")
    if settings.init_from:
        return rundir.init_state(settings.init_from, layout, optimizer), 0
    return train_step.init_state(jax.random.key(settings.seed), layout, optimizer), 0


def _resumed_state(session: Session) -> tuple[train_step.TrainState, int]:
    run, layout, optimizer = session.run, session.layout, session.optimizer
    shardings = train_step.state_shardings(layout, optimizer)
    abstract = jax.eval_shape(lambda: train_step.init_state(jax.random.key(run.train.seed), layout, optimizer))
    same_model = lambda meta: checkpoint.check_compatible(meta["config"]["model"], run.to_dict()["model"])
    restored = checkpoint.restore(session.checkpoints, abstract, shardings, session.mesh, check=same_model,
                                  set_aside=True)
    if restored is None:
        raise ConfigError(f"--resume: no checkpoint in {session.checkpoint_dir}")
    state, meta = restored
    return state, int(meta["data_position"])


def compile_step(session: Session, state, position: int):
    """The train step, the evaluation and the end-of-run sample compiled ahead (no throughput figure includes
    compilation, nothing compiles between train steps or after the last), each refused if it does not fit the
    device: (the session with its compiled evaluation and sample, the compiled step, the first batch). An
    evaluation batch has the train batch's shape and sharding."""
    compile_start = time.perf_counter()
    batch = session.batch(position)
    fp8 = fp8_options(session)
    with aot.uncached_if_pipelined(session.run.parallel, session.devices):
        step_fn = session.step_fn.lower(state, batch, session.key).compile(
            compiler_options={**fp8, **(recording(session) or {})} or None)
        eval_fn = session.eval_fn.lower(state.params, batch).compile(compiler_options=fp8 or None)
    available = aot.device_bytes(session.devices)
    aot.check_fits(aot.step_bytes(step_fn), available)
    aot.check_fits(aot.evaluation_bytes(eval_fn, step_fn, state.params), available, what="evaluation")
    sampler = (compile_sampler(state.params, session.run.model, session.mesh) if session.run.train.sample_tokens
               else None)
    if sampler is not None:
        aot.check_fits(aot.sampling_bytes(sampler, step_fn), available, what="end-of-run sample")
    if distributed.is_main_process():
        print(f"compiled the train step, the evaluation{' and the sample' if sampler else ''} in "
              f"{time.perf_counter() - compile_start:.1f} s", flush=True)
    return dataclasses.replace(session, eval_fn=eval_fn, sampler=sampler), step_fn, batch


def fp8_options(session: Session) -> dict:
    """The XLA options of an FP8 run's train step and evaluation on a GPU, under which its FP8 GEMMs compile into
    cuBLASLt's FP8 GEMMs (`model.compile_options`: the program `plan --target --fp8` reads); else none."""
    return model.compile_options(session.run.model, session.devices[0].platform)


def recording(session: Session) -> dict | None:
    """The train step's compile options: on a GPU run's main process with `--record-autotune FILE`, where XLA:GPU
    writes its autotuner's choices (train.py refuses the flag on other devices); else none."""
    path = session.run.train.record_autotune
    if not (path and distributed.is_main_process()):
        return None
    return {"xla_gpu_dump_autotune_results_to": os.path.abspath(path)}


class PendingMetrics:
    """Each step's loss and gradient norm, left on the device until a log or checkpoint boundary reads
    every pending step in one transfer (docs/DESIGN.md); and when each step was first seen complete, the
    end of its interval in the throughput figures."""

    def __init__(self):
        self._steps = []  # (step, its metrics still on the device)
        self._done = {}  # step → time.perf_counter() when the host first saw it complete

    def _stamp(self, step: int) -> None:
        self._done.setdefault(step, time.perf_counter())

    def note_ready(self) -> None:
        """Called before each dispatch: the newest step's completion time if it is complete already (a
        dispatch that returned only once its step ran, as XLA:CPU's may), which waiting for it after the
        next dispatch would put one step late. Reads nothing."""
        if self._steps and all(x.is_ready() for x in jax.tree.leaves(self._steps[-1][1])):
            self._stamp(self._steps[-1][0])

    def add(self, step: int, out: dict) -> None:
        self._steps.append((step, out))
        if len(self._steps) >= 2:
            # At most two steps in flight, one running and one queued: enough to keep the device
            # busy, and XLA:CPU's in-process collectives deadlock (its rendezvous times out) when many
            # executions hold its threads. Waits, reads nothing.
            jax.block_until_ready(self._steps[-2][1])
            self._stamp(self._steps[-2][0])

    def read(self, upto: int, last_good: int | None) -> tuple[float, float, float]:
        """Every pending step up to `upto` on the host, checked in order for non-finite values (so a
        bad step between two logs is caught before any checkpoint can hold it); upto's values and the
        time it was first seen complete."""
        done = [p for p in self._steps if p[0] <= upto]
        self._steps = [p for p in self._steps if p[0] > upto]
        for at, (loss, grad_norm) in fetch_metrics(done):
            problem = non_finite(at, loss, grad_norm, last_good)
            if problem:
                raise TrainingError(problem)
        self._stamp(upto)
        finished = self._done.pop(upto)
        self._done = {k: v for k, v in self._done.items() if k > upto}
        return loss, grad_norm, finished


class Progress:
    """The run's progress as the user sees it: the bar, and the metric records (each with the
    throughput since the previous one) written to the metrics log and, on process 0, above the bar."""

    def __init__(self, run: RunConfig, devices: list, learning_rate, start: int):
        self._run, self._devices, self._learning_rate = run, devices, learning_rate
        self._peak = run.train.peak_tflops or peak_tflops()
        self._main = distributed.is_main_process()
        # Opened once the step is known to fit: a TensorBoard writer left unused until interpreter exit
        # fails in its atexit hook on Python 3.12 (a traceback after the one-line refusal).
        self.metrics = MetricsLog(run.train.run_dir, enabled=self._main)
        self._last_time, self._last_step = time.perf_counter(), start
        self.bar = tqdm(total=run.train.steps, initial=start, disable=not self._main, unit="step",
                        mininterval=2.0, dynamic_ncols=True)

    def read(self, pending: PendingMetrics, upto: int, last_good: int | None) -> tuple[float, float, float]:
        """`pending.read`, the loss shown on the bar."""
        loss, grad_norm, finished = pending.read(upto, last_good)
        self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        return loss, grad_norm, finished

    def record(self, at: int, loss: float, grad_norm: float, finished: float) -> dict:
        """Step `at`'s record; its throughput over the steps since the previous record, timed from when
        that one's step was seen complete to `finished`, when this one's was (not when each is written: a
        record written one step late would take the next step's time, and the last the remainder). A figure not
        known here is left out: `mfu` without a known peak, `memory_gib` where the backend reports none (CPU)."""
        settings = self._run.train
        record = {"step": at, "loss": loss, "lr": self._learning_rate(at - 1), "grad_norm": grad_norm,
                  **throughput(self._run.model, settings.remat, settings.batch_size, at - self._last_step,
                               finished - self._last_time, len(self._devices), self._peak,
                               self._run.parallel.chunks),
                  "memory_gib": memory_gib()}
        self._last_time, self._last_step = finished, at
        return {key: value for key, value in record.items() if value is not None}

    def restart_clock(self) -> None:
        """Evaluation is not training time."""
        self._last_time = time.perf_counter()

    def write(self, record: dict) -> None:
        self.metrics.write(record)
        if self._main:
            self.bar.write(" ".join(f"{k}={_fmt(v)}" for k, v in record.items()))

    def close(self, checkpoints) -> None:
        """The bar closed, every checkpoint written, the metrics log closed."""
        self.bar.close()
        checkpoints.wait_until_finished()
        self.metrics.close()


def train(run: RunConfig, corpus: Corpus, clock: goodput.Clock | None = None) -> int:
    """Train to run.train.steps on `corpus`. `run` is final and validated (`train.resolve`). Returns the
    exit status: 0, or 128 + the signal's number for a run a signal stopped (its checkpoint saved). `clock`: where
    the run's wall time goes (`goodput`; the command's, its set-up timed; default one started here)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    clock = clock or goodput.Clock()
    with clock.part("set_up"):
        session = set_up(run, corpus)
        state, position = initial_state(session)
    start = int(state.step)
    if start >= run.train.steps:
        return _finished(run, start)
    profiler = profile.Profiler(_profile_window(run, start), run.train.run_dir, clock)
    with clock.part("set_up"):
        if distributed.is_main_process():
            rundir.write_config(run.train.run_dir, run)
            print(_banner(session, corpus, start), flush=True)
            for line in _offload_lines(session):
                print(line, flush=True)
        learning_rate = host_learning_rate(run.optimizer)
    # Compiled before the run's signal handlers: a signal during start-up ends the command at once
    # (`jaxseq.train.main`), with nothing to save.
    with clock.part("compile"):
        session, step_fn, batch = compile_step(session, state, position)
    with StopFlag(session.layout) as stop:
        with clock.part("set_up"):  # the metrics log opened (TensorBoard's writer)
            progress = Progress(run, session.devices, learning_rate, start)
        try:
            with clock.part("steps"):
                state, step, stopping, val_loss = _run_steps(session, step_fn, batch, state, start, position, stop,
                                                             progress, clock=clock, profiler=profiler)
        finally:  # whatever ended the steps, the checkpoints they saved are written
            profiler.stop()
            with clock.part("checkpointing"):
                progress.close(session.checkpoints)
        if stopping:
            if distributed.is_main_process():
                print(f"{stopping}: saved a checkpoint at step {step} in {session.checkpoint_dir}; resume with "
                      f"{rundir.resume_command(run)}", flush=True)
            _time_report(session, clock, profiler, start, step)
            # Not 0: a scheduler tells an interrupted run from a finished one (the shell's 128 + N).
            return 128 + signal.Signals[stopping].value
        with clock.part("sampling"):
            stopping = _closing_report(session, corpus, state, val_loss, stop)
        _time_report(session, clock, profiler, start, step)
        if stopping:  # after the last step, its checkpoint written: the sample is cut short, the status says why
            if distributed.is_main_process():
                print(f"{stopping}: the closing sample was cut short; the run had finished its {step} steps (its "
                      f"checkpoint is in {session.checkpoint_dir})", flush=True)
            return 128 + signal.Signals[stopping].value
    return 0


def _profile_window(run: RunConfig, start: int) -> profile.Window | None:
    """--profile's steps (`profile.parse_window`), which must come after the step a resumed run starts from."""
    window = profile.parse_window(run.train.profile, run.train.steps)
    if window is not None and window.start <= start:
        later = f"{start + 1}:{start + 1 + window.stop - window.start}"
        raise ConfigError(f"profile={run.train.profile!r}: the run resumes after step {start}, past step "
                          f"{window.start}; trace later steps (e.g. {later})")
    return window


def _time_report(session: Session, clock: goodput.Clock, profiler: profile.Profiler, start: int, step: int) -> None:
    """The closing lines on process 0: where the wall time of steps start+1 … step went (`goodput`, also
    metrics.jsonl's last record) and the profile's files."""
    if not distributed.is_main_process():
        return
    run, steps = session.run, step - start
    mfu = throughput(run.model, run.train.remat, run.train.batch_size, steps, clock.seconds["steps"],
                     len(session.devices), run.train.peak_tflops or peak_tflops(), run.parallel.chunks)["mfu"]
    record = clock.report(steps, mfu if steps else None)
    goodput.write_record(run.train.run_dir, step, record)
    print(goodput.format_line(record), flush=True)
    if profiler.line() is not None:
        print(profiler.line(), flush=True)


def _finished(run: RunConfig, start: int) -> int:
    """A resume of a run whose checkpoint is at (or past) its last step: nothing to train."""
    steps = run.train.steps
    if start > steps:
        raise ConfigError(f"--resume: the newest checkpoint of {run.train.run_dir} is at step {start}, past "
                          f"steps={steps}: nothing to train; to continue the run pass --steps N with N > {start}")
    if distributed.is_main_process():
        print(f"{run.train.run_dir} has finished its {steps} steps: nothing to train; to continue it, "
              f"--resume --steps N with N > {steps}", flush=True)
    return 0


def _run_steps(session: Session, step_fn, batch, state, step: int, position: int, stop: StopFlag,
               progress: Progress, *, clock: goodput.Clock, profiler: profile.Profiler):
    """The steps after `step` (with `batch` the first one's) to the last, or to the one a signal
    stops the run at: (state, step, the signal's name or None, the last validation loss or None).
    Logs, checkpoints and evaluates on the boundaries, saving before evaluating: an evaluation that
    fails loses no checkpoint. `clock` times the evaluations and checkpoints apart from the steps; `profiler` traces
    its window's steps (timing its own work apart from them too)."""
    settings = session.run.train
    pending, last_good, late_log, val_loss = PendingMetrics(), None, None, None
    while step < settings.steps:
        # Between boundaries nothing on the host waits for the device: the step is dispatched, the
        # next batch built while it runs, and its loss and gradient norm stay on the device. On a
        # GPU, whose step is short, a per-step fetch would leave it idle while the host catches up.
        pending.note_ready()
        profiler.before(step + 1)
        with jax.transfer_guard_device_to_host("disallow"):
            with profiler.annotate(step + 1):
                state, out = step_fn(state, batch, session.key)
            step, position = step + 1, position + 1
            if step < settings.steps:  # the host reads the next batch while the device runs this step
                batch = session.batch(position)
            pending.add(step, out)
            progress.bar.update(1)
        profiler.after(step, out)
        # Agreed by every process (all save the same step); it reads the previous step's flag, so by
        # then this step is queued and the device is not left waiting.
        stopping = stop.after_step()
        if late_log is not None:  # the previous step's record, written while this step runs
            progress.write(progress.record(late_log, *progress.read(pending, late_log, last_good)))
            late_log = None
        evaluate_now = step % settings.eval_every == 0 or step == settings.steps
        log_now = step % settings.log_every == 0 or evaluate_now  # an evaluated step is a full record too
        save_now = step % settings.checkpoint_every == 0 or step == settings.steps or stopping
        if not (save_now or evaluate_now):
            # A log-only step is read one step late, once the next step is queued: reading it now
            # would drain the device's queue and leave it idle while the host writes the record.
            late_log = step if log_now else None
            continue
        # Saving or evaluating uses this step's state, which the next step would consume (donated).
        loss, grad_norm, finished = progress.read(pending, step, last_good)
        record = progress.record(step, loss, grad_norm, finished) if log_now else None
        if save_now:
            with clock.part("checkpointing"):
                session.save(step, state, position)
            last_good = step
        if evaluate_now:
            with clock.part("evaluation"):
                val_loss = record["val_loss"] = session.evaluate(state.params)
            progress.restart_clock()
        if record:
            progress.write(record)
        if stopping:
            return state, step, stopping, val_loss
    return state, step, None, val_loss


def _banner(session: Session, corpus: Corpus, start: int) -> str:
    run, p = session.run, session.run.parallel
    return (f"jaxseq: {run.model.family} with {model.num_params(run.model) / 1e6:.2f}M parameters, {corpus.name} "
            f"({len(corpus.train):,} train / {len(corpus.val):,} val tokens), mesh {p.mesh_text()}"
            f"{' + SP' if p.sequence_parallel else ''}{' + distributed optimizer' if p.distributed_optimizer else ''}"
            f"{_pipeline_text(p, session.micro_batches)} on {len(session.devices)} "
            f"{session.devices[0].platform} devices, remat={run.train.remat}, steps {start}→{run.train.steps}")


def _offload_lines(session: Session) -> list[str]:
    """What the run keeps in host memory, and where that is on these devices (`offload.platform_note`)."""
    run, platform = session.run, session.devices[0].platform
    lines = [host_offload.platform_note(host_offload.parse(run.train.offload), platform)]
    if run.parallel.offload_optimizer:
        lines.append(host_offload.optimizer_note(platform))
    return [line for line in lines if line]


def _closing_report(session: Session, corpus: Corpus, state, val: float, stop: StopFlag) -> str | None:
    """The last step's validation loss `val` (evaluated by the step loop) against the data's unigram
    entropy, and a sample continuing the start of a validation document, drawn from the train state's params
    resharded for sampling by the programs `compile_step` compiled (`compile_sampler`: never gathered, nothing
    compiled now). Every process computes (the arrays span them all); process 0 prints. A signal since the last
    step (agreed by every process, checked before each sampled token) ends the sample: its name is returned."""
    run, settings = session.run, session.run.train
    if distributed.is_main_process():
        entropy = unigram_entropy(corpus.train, corpus.vocab_size)
        print(f"validation loss {val:.3f} nats/token vs unigram entropy {entropy:.3f} nats/token "
              f"({corpus.name}); checkpoint: {session.checkpoint_dir}", flush=True)
    stopping = stop.now()
    if not settings.sample_tokens or stopping:  # sample_tokens=0: no sample, and no prompt printed as if it were one
        return stopping
    prompt, sampler = validation_prompt(corpus, run.model.seq_len // 2), session.sampler

    def stopped() -> bool:  # the agreement dispatched at the token before, so no token waits for one
        nonlocal stopping
        stopping = stop.after_step()
        return stopping is not None

    ids = sample(sampler.reshard(state.params), run.model, prompt_ids(prompt, corpus.tokenizer, run.model.vocab_size),
                 settings.sample_tokens, seed=settings.seed, programs=sampler, stop=stopped)
    if stopping:
        return stopping
    if distributed.is_main_process():
        print("sample (prompt: the start of a validation document):\n" +
              printable(prompt + decode_tokens(ids, corpus.tokenizer)), flush=True)
    return None


def _pipeline_text(p: ParallelConfig, micro: int) -> str:
    if p.pipe == 1:
        return ""
    sched = Schedule.make(p.schedule, p.pipe, micro, p.virtual_stages)
    return (f", {sched.name} schedule (v={sched.v}, m={micro} micro-batches, {sched.ticks} ticks, "
            f"bubble {sched.bubble:.3f})")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return str(v)
