"""The step loop does not block on the device between log/checkpoint boundaries, and still stops on a
non-finite step before any checkpoint holds it; it saves before it evaluates, evaluates the last step
once, and leaves no signal handler behind (in-process, tiny model, 8 simulated devices)."""

import dataclasses
import json
import os
import signal
import time

import jax
import numpy as np
import pytest
from jax._src.array import ArrayImpl

from jaxseq.config import ConfigError, OptimizerConfig, ParallelConfig, RunConfig, TrainConfig, replace
from jaxseq.presets import preset
from jaxseq.mesh import make_mesh
from jaxseq.parallel.layout import Layout
from jaxseq.training.data import load_corpus
from jaxseq.training import loop
from jaxseq.training import train_step as T

SIGNALS = (signal.SIGTERM, signal.SIGINT)  # the ones a run handles (to checkpoint and stop)

TP_SP = ParallelConfig(data=2, tensor=4, sequence_parallel=True)
# The tiny preset's 2 layers over 2 stages, 1F1B over m = 8 / 2 = 4 micro-batches.
PIPELINED = ParallelConfig(data=2, tensor=2, sequence_parallel=True, pipe=2, schedule="1f1b")


def _run(tmp_path, steps, log_every, checkpoint_every, lr=1e-3, eval_every=10_000, parallel=TP_SP):
    text = tmp_path / "corpus.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 400)
    model = replace(preset("tiny"), dtype="float32", dropout=0.0)
    train = TrainConfig(steps=steps, batch_size=8, micro_batch_size=2 if parallel.pipe > 1 else None,
                        log_every=log_every, eval_every=eval_every, eval_batches=1,
                        checkpoint_every=checkpoint_every, data=str(text), run_dir=str(tmp_path / "run"),
                        sample_tokens=2)
    os.makedirs(train.run_dir, exist_ok=True)
    corpus = load_corpus(train.data, None)
    model = replace(model, vocab_size=corpus.vocab_size)
    optimizer = OptimizerConfig(lr=lr, warmup_steps=0, decay_steps=steps)
    return RunConfig(model=model, parallel=parallel, optimizer=optimizer, train=train), corpus


def test_no_device_value_is_read_between_log_boundaries(tmp_path, devices, monkeypatch):
    """6 steps logged every 3: the host reads device values (any `jax.Array` → NumPy: float(), np.asarray,
    device_get) only once step 4 is dispatched (step 3's record, one step late so that the device's
    queue never drains) and after the last step, each time every pending step's metrics in one fetch.
    (The loop's transfer guard says the same on accelerators; on CPU an array is already on the host,
    so the guard does not fire and reads are counted here instead.)"""
    events = []  # ("step", None) at each train-step dispatch, ("read", None) at each host read
    original_call = jax.stages.Compiled.__call__
    original_value = ArrayImpl._value

    def call(compiled, *args, **kwargs):
        if len(args) == 3 and type(args[0]).__name__ == "TrainState":
            events.append("step")
        return original_call(compiled, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Compiled, "__call__", call)
    # The coordinated stop flag reads one tiny value per step, one step late (the next step already
    # queued) by design; it is not what this test is about.
    monkeypatch.setattr(loop.StopFlag, "after_step", lambda self: None)
    monkeypatch.setattr(ArrayImpl, "_value", property(lambda self: events.append("read") or original_value.fget(self)))
    fetched = []
    real_fetch = loop.fetch_metrics
    monkeypatch.setattr(loop, "fetch_metrics",
                        lambda pending: fetched.append([s for s, _ in pending]) or real_fetch(pending))

    assert loop.train(*_run(tmp_path, steps=6, log_every=3, checkpoint_every=10_000)) == 0
    first = events.index("step")
    reads_after = [0] * 6  # host reads after step k's dispatch, before step k+1's (or the loop's end)
    step = -1
    for e in events[first:]:
        if e == "step":
            step += 1
        elif step < 5:
            reads_after[step] += 1
    assert [n > 0 for n in reads_after[:5]] == [False, False, False, True, False], reads_after
    assert fetched == [[1, 2, 3], [4, 5, 6]]


@pytest.mark.parametrize("parallel", [TP_SP, pytest.param(PIPELINED, marks=pytest.mark.slow)], ids=["tp-sp", "pipe2"])
def test_nothing_compiles_between_train_steps(parallel, tmp_path, devices, monkeypatch):
    """Between the first and the last train step the loop compiles nothing: a compilation in the log
    path (the learning rate once took 0.45 s at the first log), the stop flag or the evaluation (here
    after steps 2 and 4, between train steps; pipelined with a pipeline) idles the device. Nor does the closing
    report: the end-of-run sample's programs were compiled (and fit-checked) with the train step."""
    events = []
    original_call = jax.stages.Compiled.__call__

    def call(compiled, *args, **kwargs):
        if len(args) == 3 and type(args[0]).__name__ == "TrainState":
            events.append("step")
        return original_call(compiled, *args, **kwargs)

    original_evaluate = loop.Session.evaluate

    def evaluate(session, params):
        events.append("evaluate")
        return original_evaluate(session, params)

    def compiled(event, duration, **kwargs):
        # A compilation, or its program loaded from the session's compilation cache (conftest.py).
        if event in ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_retrieval_time_sec"):
            events.append("compile")

    original_closing = loop._closing_report

    def closing_report(*args):
        events.append("closing")
        stopping = original_closing(*args)
        events.append("closed")
        return stopping

    monkeypatch.setattr(jax.stages.Compiled, "__call__", call)
    monkeypatch.setattr(loop.Session, "evaluate", evaluate)
    monkeypatch.setattr(loop, "_closing_report", closing_report)
    jax.monitoring.register_event_duration_secs_listener(compiled)
    try:
        assert loop.train(*_run(tmp_path, steps=6, log_every=2, checkpoint_every=10_000, eval_every=2,
                                parallel=parallel)) == 0
    finally:
        jax.monitoring.unregister_event_duration_listener(compiled)
    between = events[events.index("step"): len(events) - events[::-1].index("step")]
    assert between.count("step") == 6 and between.count("evaluate") == 2 and "compile" not in between, between
    # The closing report: the last step's evaluation reused, the sample's programs compiled before the first step
    closing = events[events.index("closing"): events.index("closed")]
    assert "compile" not in closing and "evaluate" not in closing, closing


@pytest.fixture
def own_signal_handlers():
    """A handler of the test's own on SIGTERM and SIGINT while it runs: what a run must leave in place."""
    mine = lambda signum, frame: None  # noqa: E731
    saved = {sig: signal.signal(sig, mine) for sig in SIGNALS}
    yield mine
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_a_non_finite_step_between_logs_stops_before_any_checkpoint(tmp_path, devices, own_signal_handlers):
    with pytest.raises(loop.TrainingError, match=r"non-finite .* at step [123] .*none written"):
        loop.train(*_run(tmp_path, steps=8, log_every=4, checkpoint_every=4, lr=1e30))
    assert not os.listdir(tmp_path / "run" / "checkpoints")
    # The run's SIGTERM/SIGINT handlers went with it, though an exception ended it.
    assert [signal.getsignal(sig) for sig in SIGNALS] == [own_signal_handlers] * 2


def test_the_last_step_is_evaluated_once_and_its_loss_reported(tmp_path, devices, own_signal_handlers,
                                                                 monkeypatch, capsys):
    """4 steps evaluated every 2: two evaluations (steps 2 and 4); the closing report prints step 4's
    validation loss rather than evaluating again. The run's signal handlers are gone after it. The sample is
    printed as text: bytes the model drew that are no text (0x0e, which switched the terminal to its other
    character set, 0x1b, 0x00, a lone 0xff) are U+FFFD, newlines and tabs stay."""
    evaluated = []
    real_evaluate, real_sample = loop.Session.evaluate, loop.sample
    monkeypatch.setattr(loop.Session, "evaluate",
                        lambda self, params: evaluated.append(1) or real_evaluate(self, params))
    drawn = [0x0E, ord("a"), 0x1B, 0x00, 0xFF, ord("\t"), ord("\n"), ord("b")]
    monkeypatch.setattr(loop, "sample", lambda *args, **kwargs: real_sample(*args, **kwargs) and drawn)
    assert loop.train(*_run(tmp_path, steps=4, log_every=2, checkpoint_every=10_000, eval_every=2)) == 0
    assert len(evaluated) == 2
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        val = [r["val_loss"] for r in map(json.loads, f) if "val_loss" in r]
    out = capsys.readouterr().out
    assert len(val) == 2 and f"validation loss {val[-1]:.3f} nats/token" in out
    sample, time_line = out.removesuffix("\n").rsplit("\n", 1)  # the sample, then where the time went (goodput.py)
    assert sample.endswith("\ufffda\ufffd\ufffd\ufffd\t\nb") and time_line.startswith("time: "), out[-300:]
    assert [signal.getsignal(sig) for sig in SIGNALS] == [own_signal_handlers] * 2


def test_a_failed_evaluation_at_a_checkpoint_step_keeps_the_checkpoint(tmp_path, devices, monkeypatch):
    """Step 2 both saves and evaluates: the checkpoint is written before the evaluation, so an
    evaluation that fails there (out of memory, say) loses nothing, and the run can resume from it."""
    def failing(self, params):
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(loop.Session, "evaluate", failing)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        loop.train(*_run(tmp_path, steps=4, log_every=2, checkpoint_every=2, eval_every=2))
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["2"]


def test_an_evaluation_that_cannot_fit_is_refused_before_the_first_step(tmp_path, devices, monkeypatch):
    """The fit check covers the evaluation too (compiled ahead with the train step): the train state and the
    next batch stay alive while it runs, so its bytes are those plus its own batch, temporaries and output.
    Here the train step is made to fit (0 bytes) on a device of 1 byte: the evaluation is refused in one line."""
    monkeypatch.setattr(loop.aot, "step_bytes", lambda compiled: 0)
    monkeypatch.setattr(loop.aot, "device_bytes", lambda devices: 1)
    with pytest.raises(ConfigError, match=r"^the compiled evaluation needs [0-9.]+ GiB per device but a device has "
                                          r"0\.00 GiB; try a smaller --micro-batch-size") as e:
        loop.train(*_run(tmp_path, steps=2, log_every=1, checkpoint_every=10_000))
    assert "\n" not in str(e.value)


def test_a_sample_that_cannot_fit_is_refused_before_the_first_step(tmp_path, devices, monkeypatch):
    """The end-of-run sample's programs are compiled and fit-checked with the train step: the train state
    stays alive beside the resharded weights and the KV cache. The step and the evaluation made to fit
    (0 bytes) on a device of 1 byte: the sample is refused in one line, before any step runs."""
    monkeypatch.setattr(loop.aot, "step_bytes", lambda compiled: 0)
    monkeypatch.setattr(loop.aot, "evaluation_bytes", lambda *args: 0)
    monkeypatch.setattr(loop.aot, "device_bytes", lambda devices: 1)
    with pytest.raises(ConfigError, match=r"^the compiled end-of-run sample needs [0-9.]+ GiB per device but a "
                                          r"device has 0\.00 GiB; try sample_tokens=0") as e:
        loop.train(*_run(tmp_path, steps=2, log_every=1, checkpoint_every=10_000))
    assert "\n" not in str(e.value) and not os.path.exists(tmp_path / "run" / "metrics.jsonl")


@pytest.mark.parametrize("when", ["sample", "evaluation"])
def test_a_signal_after_the_last_step_ends_the_run_with_128_plus_its_number(when, tmp_path, devices,
                                                                            own_signal_handlers, monkeypatch, capsys):
    """SIGTERM (a preemption notice) during the closing sample, or during the last step's evaluation: the sample
    stops a token later (every process agrees on the flag dispatched at the token before, `StopFlag.after_step`,
    so that no token waits for the agreement), and the run ends with 143 once its last checkpoint is written.
    Before, a 20,000-token sample ran on for 60 s and the run exited 0."""
    real_sample, decoded = loop.sample, []

    def sample(*args, programs, **kwargs):
        def decode(*a):
            if not decoded and when == "sample":
                os.kill(os.getpid(), signal.SIGTERM)
            decoded.append(1)
            return programs.decode(*a)

        return real_sample(*args, programs=dataclasses.replace(programs, decode=decode), **kwargs)

    real_evaluate = loop.Session.evaluate

    def evaluate(session, params):
        if when == "evaluation":
            os.kill(os.getpid(), signal.SIGTERM)
        return real_evaluate(session, params)

    monkeypatch.setattr(loop, "sample", sample)
    monkeypatch.setattr(loop.Session, "evaluate", evaluate)
    run, corpus = _run(tmp_path, steps=2, log_every=1, checkpoint_every=10_000, eval_every=2)
    assert loop.train(replace(run, train=replace(run.train, sample_tokens=200)), corpus) == 143
    assert len(decoded) == (2 if when == "sample" else 0)
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["2"]
    out = capsys.readouterr().out
    assert "SIGTERM: the closing sample was cut short; the run had finished its 2 steps" in out
    assert "validation loss" in out and "sample (prompt" not in out


def test_evaluation_runs_the_train_steps_micro_batches(devices):
    """Without a pipeline the evaluation runs the batch's micro-batches one at a time, as the train step does:
    the same loss as the whole batch at once, with the temporaries of one micro-batch (the whole batch's
    logits alone are 4·B·s·V/t bytes)."""
    cfg = replace(preset("tiny"), dtype="float32", dropout=0.0)
    layout = Layout(cfg, TP_SP, make_mesh(TP_SP, devices))
    params = T.init_state(jax.random.key(0), layout, T.make_optimizer(OptimizerConfig(), cfg)).params
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (16, cfg.seq_len + 1), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    temp, loss = {}, {}
    for m in (1, 4):
        program = loop.make_eval_fn(layout, m).lower(params, batch).compile()
        temp[m], loss[m] = program.memory_analysis().temp_size_in_bytes, float(program(params, batch))
    assert abs(loss[4] - loss[1]) <= 1e-6 * loss[1]
    logits = 4 * 16 * cfg.seq_len * cfg.padded_vocab(TP_SP.tensor) // TP_SP.tensor // TP_SP.data
    assert temp[1] - temp[4] >= logits * 3 // 4, (temp, logits)


def test_every_record_times_its_own_steps(tmp_path, devices, monkeypatch):
    """Each record's tokens/s is timed from when the previous record's step was seen complete to when its own
    was. A record written one step late (log-only steps are) once took its time from when it was written: after
    a dispatch that returned only once its step ran (XLA:CPU's may), that is the next step's end, and the last
    record got the remainder, ~0 s: 51,467 tokens/s where every other said ~15,000 (68× in a gpt2-124m run).
    Here every dispatch runs its step and then 0.3 s more, so each step takes 0.3 s or more and every record
    about the same."""
    real_compile = loop.compile_step

    def synchronous(session, state, position):
        session, step_fn, batch = real_compile(session, state, position)

        def step(*args):
            out = jax.block_until_ready(step_fn(*args))
            time.sleep(0.3)
            return out

        return session, step, batch

    monkeypatch.setattr(loop, "compile_step", synchronous)
    run, corpus = _run(tmp_path, steps=4, log_every=1, checkpoint_every=10_000)
    assert loop.train(run, corpus) == 0
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        rates = [r["tokens_per_sec"] for r in map(json.loads, f) if "run" not in r]  # not the closing time record
    tokens = run.train.batch_size * run.model.seq_len
    # every record took at least its own 0.3 s, and none the ~0 s remainder (the bug's was 68× the others'); no
    # upper bound on a step's time, which a loaded machine stretches (the old bound of 0.5 s failed under load)
    assert len(rates) == 4 and all(rate < tokens / 0.3 for rate in rates) and max(rates) < 3 * min(rates), rates


def test_a_record_leaves_out_what_is_not_known(tmp_path, devices, capsys):
    """On CPU there is no peak for MFU and no count of device memory: a record (the printed line and metrics.jsonl)
    leaves `mfu` and `memory_gib` out, where every line ended `mfu=None memory_gib=None`; with a peak given, MFU is
    there."""
    run, _ = _run(tmp_path, steps=4, log_every=1, checkpoint_every=10_000)
    known = {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "tflops_per_device", "hardware_tflops_per_device"}
    for peak in (None, 100.0):
        run = replace(run, train=replace(run.train, peak_tflops=peak))
        progress = loop.Progress(run, devices, lambda step: 1e-3, 0)
        progress.write(progress.record(1, 2.0, 0.5, time.perf_counter() + 1.0))
        progress.close(loop.checkpoint.manager(str(tmp_path / "checkpoints")))
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        assert [set(json.loads(line)) for line in f] == [known, known | {"mfu"}]
    assert "None" not in capsys.readouterr().out


def test_a_signal_saves_and_ends_the_run_with_128_plus_its_number(tmp_path, devices, own_signal_handlers,
                                                                   monkeypatch, capsys):
    """SIGINT during the steps (as Ctrl-C sends it): a checkpoint at the step every process agrees on, then
    exit status 130 (128 + 2, the shell's convention), not 0: a scheduler tells an interrupted run from a
    finished one. SIGTERM gives 143 (tests/test_train.py)."""
    real_after_step = loop.StopFlag.after_step
    sent = []

    def after_step(flag):
        if not sent:
            os.kill(os.getpid(), signal.SIGINT)
            sent.append(True)
        return real_after_step(flag)

    monkeypatch.setattr(loop.StopFlag, "after_step", after_step)
    assert loop.train(*_run(tmp_path, steps=50, log_every=1, checkpoint_every=10_000)) == 130
    saved = os.listdir(tmp_path / "run" / "checkpoints")
    assert len(saved) == 1 and int(saved[0]) < 50
    # The whole command to continue it: `--resume` alone would resume runs/default.
    assert (f"SIGINT: saved a checkpoint at step {saved[0]} in {tmp_path}/run/checkpoints; resume with "
            f"python -m jaxseq.train --run-dir {tmp_path}/run --resume\n") in capsys.readouterr().out
