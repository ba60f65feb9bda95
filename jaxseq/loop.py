"""The training loop: devices and mesh, data, the jit-compiled step, evaluation, metrics, checkpoints."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm import tqdm

from jaxseq import checkpoint as C
from jaxseq import distributed as D
from jaxseq import model as M
from jaxseq import train_step as T
from jaxseq.config import ConfigError, DistributedConfig, ModelConfig, OptimizerConfig, ParallelConfig, RunConfig, replace
from jaxseq.data import Batches, load_corpus, unigram_entropy
from jaxseq.generate import decode_tokens, encode_text, sample
from jaxseq.mesh import Sharder, make_mesh
from jaxseq.metrics import MetricsLog, memory_gib, peak_tflops, throughput

log = logging.getLogger("jaxseq")


class TrainingError(RuntimeError):
    """The run cannot go on (a non-finite loss); the message is one line."""


def num_devices() -> int:
    return len(_devices())


def _devices():
    accel = [d for d in jax.devices() if d.platform != "cpu"]
    return accel or jax.devices("cpu")


def setup_devices(configs: dict, mesh_text: str | None, sequence_parallel: bool | None,
                  distributed: DistributedConfig) -> RunConfig:
    """Configure simulated CPU devices and the distributed runtime, then resolve the mesh."""
    train = configs["train"]
    # Must precede any device query; harmless where an accelerator exists.
    jax.config.update("jax_num_cpu_devices", train.host_devices)
    D.initialize(distributed)
    devices = _devices()
    on_cpu = devices[0].platform == "cpu"
    if mesh_text is None:
        mesh_text = "data=2,tensor=4" if on_cpu and len(devices) == 8 else f"data={len(devices)},tensor=1"
    from jaxseq.train import parse_mesh

    data, tensor = parse_mesh(mesh_text, len(devices))
    if sequence_parallel is None:
        sequence_parallel = tensor > 1
    return RunConfig(configs["model"], ParallelConfig(data, tensor, sequence_parallel), configs["optimizer"], train, distributed)


def _eval_fn(cfg: ModelConfig, parallel: ParallelConfig, mesh):
    shard = Sharder(mesh, parallel.sequence_parallel)
    param_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), T.param_specs(cfg, parallel))
    batch_sh = {"inputs": T.batch_sharding(mesh), "targets": T.batch_sharding(mesh)}
    return jax.jit(lambda p, b: M.loss_fn(p, b, cfg, shard, "none"), in_shardings=(param_sh, batch_sh),
                   out_shardings=NamedSharding(mesh, P()))


def _global(batch: dict, mesh, batch_size: int) -> dict:
    return D.global_batch(batch, T.batch_sharding(mesh), batch_size)


def evaluate(eval_fn, params, batches: Batches, n: int, mesh, rows: slice) -> float:
    losses = [float(eval_fn(params, _global(batches.rows(i, rows), mesh, batches.batch_size))) for i in range(n)]
    return float(np.mean(losses))


class StopFlag:
    """SIGTERM / SIGINT ask the loop to checkpoint and exit at the end of the current step."""

    def __init__(self):
        self.signal = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._set)

    def _set(self, signum, frame):
        self.signal = signal.Signals(signum).name


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


def _meta(run: RunConfig, position: int) -> dict:
    return {"data_position": position, "config": run.to_dict()}


def train(run: RunConfig, init_from: str | None = None) -> int:
    """Train to run.train.steps; `init_from`: a run or converted directory whose weights start the run."""
    t = run.train
    main = D.is_main_process()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    corpus = load_corpus(t.data, t.tokenizer)
    # The data defines the vocabulary (and, for token files, the tokenizer); initial weights may hold more.
    vocab = corpus.vocab_size
    if init_from:
        from jaxseq import convert

        vocab = convert.data_vocab(init_from, vocab)
    run = RunConfig(replace(run.model, vocab_size=vocab), run.parallel, run.optimizer,
                    replace(t, tokenizer=corpus.tokenizer), run.distributed)
    mesh = make_mesh(run.parallel, _devices())
    optimizer = T.make_optimizer(run.optimizer)
    micro = (t.batch_size // t.micro_batch_size) if t.micro_batch_size else 1
    step_fn = T.make_train_step(run.model, run.parallel, t.remat, optimizer, mesh, micro_batches=micro)
    eval_fn = _eval_fn(run.model, run.parallel, mesh)
    rows = D.local_batch_rows(T.batch_sharding(mesh), t.batch_size, run.model.seq_len)
    train_batches = Batches(corpus.train, run.model.seq_len, t.batch_size, t.seed)
    val_batches = Batches(corpus.val, run.model.seq_len, t.batch_size, t.seed + 1)

    ckpt_dir = os.path.join(t.run_dir, "checkpoints")
    mgr = C.manager(ckpt_dir, keep=t.keep_checkpoints)
    shardings = T.state_shardings(run.model, run.parallel, optimizer, mesh)
    abstract = jax.eval_shape(lambda: T.init_state(jax.random.key(t.seed), run.model, run.parallel, optimizer, mesh))
    if t.resume:
        restored = C.restore(mgr, abstract, shardings, mesh,
                             check=lambda meta: C.check_compatible(meta["config"]["model"], run.to_dict()["model"]))
        if restored is None:
            raise ConfigError(f"--resume: no checkpoint in {ckpt_dir}")
        state, meta = restored
        position = int(meta["data_position"])
    else:
        if mgr.all_steps():
            raise ConfigError(f"run_dir={t.run_dir!r} already holds checkpoints; pass --resume or another --run-dir")
        if init_from:
            state = convert.init_state(init_from, run.model, run.parallel, optimizer, mesh)
        else:
            state = T.init_state(jax.random.key(t.seed), run.model, run.parallel, optimizer, mesh)
        position = 0
    start = int(state.step)
    if main:
        with open(os.path.join(t.run_dir, "config.json"), "w") as f:
            json.dump(run.to_dict(), f, indent=2)
    metrics = MetricsLog(t.run_dir, enabled=main)
    peak = t.peak_tflops or peak_tflops()
    entropy = unigram_entropy(corpus.train, corpus.vocab_size)
    if main:
        p = run.parallel
        print(f"jaxseq: {run.model.num_params() / 1e6:.2f}M parameters, {corpus.name} "
              f"({len(corpus.train):,} train / {len(corpus.val):,} val tokens), mesh data={p.data} × tensor={p.tensor}"
              f"{' + SP' if p.sequence_parallel else ''} on {num_devices()} {_devices()[0].platform} devices, "
              f"remat={t.remat}, steps {start}→{t.steps}", flush=True)

    stop = StopFlag()
    key = jax.random.key(t.seed + 1)
    schedule = T.learning_rate_schedule(run.optimizer)
    batch_at = lambda pos: _global(train_batches.rows(pos, rows), mesh, t.batch_size)
    # Compile ahead so that no throughput figure includes compilation.
    if start < t.steps:
        compile_start = time.perf_counter()
        batch = batch_at(position)
        step_fn = step_fn.lower(state, batch, key).compile()
        if main:
            print(f"compiled the train step in {time.perf_counter() - compile_start:.1f} s", flush=True)
    last_time, last_step, last_good = time.perf_counter(), start, None
    bar = tqdm(total=t.steps, initial=start, disable=not main, unit="step", mininterval=2.0, dynamic_ncols=True)
    step = start
    while step < t.steps:
        state, out = step_fn(state, batch, key)
        step, position = step + 1, position + 1
        if step < t.steps:
            batch = batch_at(position)  # the host reads the next batch while the device runs this step
        loss, grad_norm = float(out["loss"]), float(out["grad_norm"])
        problem = non_finite(step, loss, grad_norm, last_good)
        if problem:
            bar.close()
            mgr.wait_until_finished()
            raise TrainingError(problem)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        record = None
        evaluate_now = step % t.eval_every == 0 or step == t.steps
        if step % t.log_every == 0 or evaluate_now:  # an evaluated step is a full record too
            now = time.perf_counter()
            record = {"step": step, "loss": loss, "lr": float(schedule(step - 1)), "grad_norm": grad_norm,
                      **throughput(run.model, t.remat, t.batch_size, step - last_step, now - last_time,
                                   num_devices(), peak),
                      "memory_gib": memory_gib()}
            last_time, last_step = now, step
        if evaluate_now:
            record["val_loss"] = evaluate(eval_fn, state.params, val_batches, t.eval_batches, mesh, rows)
            last_time = time.perf_counter()  # evaluation is not training time
        if record:
            metrics.write(record)
            if main:
                bar.write(" ".join(f"{k}={_fmt(v)}" for k, v in record.items()))
        if step % t.checkpoint_every == 0 or step == t.steps or stop.signal:
            C.save(mgr, step, state, _meta(run, position), force=True)
            last_good = step
        if stop.signal:
            bar.close()
            mgr.wait_until_finished()
            if main:
                print(f"{stop.signal}: saved a checkpoint at step {step} in {ckpt_dir}; resume with --resume")
            metrics.close()
            return 0
    bar.close()
    mgr.wait_until_finished()
    metrics.close()
    if start < t.steps:  # every process computes (the arrays span them all); process 0 prints
        val = evaluate(eval_fn, state.params, val_batches, t.eval_batches, mesh, rows)
        prompt = "def "
        ids = sample(state.params, run.model, encode_text(prompt, corpus.tokenizer), t.sample_tokens, seed=t.seed)
        if main:
            print(f"validation loss {val:.3f} nats/token vs unigram entropy {entropy:.3f} nats/token "
                  f"({corpus.name}); checkpoint: {ckpt_dir}")
            print("sample:\n" + prompt + decode_tokens(ids, corpus.tokenizer))
    return 0


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return str(v)


def load_run(run_dir: str):
    """The newest checkpoint of a run on one device: (model config, params, tokenizer path, step)."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"run_dir={run_dir!r} has no config.json (not a jaxseq run directory)")
    saved = json.load(open(path))
    cfg = ModelConfig(**saved["model"])
    parallel = ParallelConfig(1, 1)
    mesh = make_mesh(parallel, jax.devices()[:1])
    optimizer = T.make_optimizer(OptimizerConfig(**saved["optimizer"]))
    abstract = jax.eval_shape(lambda: T.init_state(jax.random.key(0), cfg, parallel, optimizer, mesh))
    restored = C.restore(C.manager(os.path.join(run_dir, "checkpoints"), async_save=False), abstract,
                         T.state_shardings(cfg, parallel, optimizer, mesh), mesh)
    if restored is None:
        raise ConfigError(f"run_dir={run_dir!r} holds no checkpoint")
    state, _ = restored
    return cfg, state.params, saved["train"].get("tokenizer"), int(state.step)
