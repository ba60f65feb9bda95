"""The training command on the `tiny` preset, run as a user runs it: in the pytest process
(`jaxseq.train.main`), and as `python -m jaxseq.train` where a signal reaches the process."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from commands import ROOT, command, env, python_m
from jaxseq import data as data_command
from jaxseq import generate as generate_command
from jaxseq import train as train_command
from jaxseq.train import main

TINY = ["--preset", "tiny", "--dtype", "float32", "--batch-size", "8", "--mesh", "data=2,tensor=4",
        "--host-devices", "8", "--log-every", "1", "--eval-every", "5", "--warmup-steps", "2", "eval_batches=1",
        "sample_tokens=8"]


def run(*args, check=True):
    """`python -m jaxseq.train args`, in this process."""
    return command(train_command.main, *args, check=check)


def metrics(run_dir):
    """The steps' records (not a run's closing time record, `"run": "time"`: training/goodput.py)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "run" not in r]


def losses(run_dir):
    return {m["step"]: m["loss"] for m in metrics(run_dir)}


def check_metrics_and_config(run_dir):
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 11))
    for r in records:
        for key in ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "tflops_per_device"):
            assert key in r, key
        assert "mfu" not in r and "memory_gib" not in r  # CPU: no known peak, no count of device memory
        assert r["tokens_per_sec"] > 0 and r["tflops_per_device"] > 0
    assert "val_loss" in records[4] and "val_loss" in records[9]
    config = json.load(open(os.path.join(run_dir, "config.json")))
    assert config["parallel"] == {"data": 2, "tensor": 4, "sequence_parallel": True, "distributed_optimizer": False,
                                  "pipe": 1, "schedule": "1f1b", "virtual_stages": 1, "context": 1,
                                  "context_strategy": "all-gather", "fsdp": 1, "expert": 1, "offload_optimizer": False}
    assert config["model"]["hidden"] == 64 and config["train"]["steps"] == 10
    assert os.listdir(os.path.join(run_dir, "tensorboard"))


@pytest.mark.slow
def test_metrics_and_resume_with_the_same_losses_on_any_mesh(tmp_path):
    """One test, so that the 10-step reference runs once: a 5-step run extended by `--resume --steps 10`
    keeps its schedule (the cosine ends at step 5; steps 6-10 stay at the final learning rate), so it
    equals one 10-step run whose schedule ends at 5 (to 1e-6); a resume from the same 5-step
    checkpoint onto data=2 × fsdp=2 × tensor=2 (HSDP: the weights and their state split over fsdp too) continues
    with the same losses (to 1e-4)."""
    straight, halves, other_mesh = (str(tmp_path / name) for name in ("straight", "halves", "other"))
    # No end-of-run sample (nothing here reads it; test_train_and_generate_on_token_files does): no sampler compiled.
    tiny = [*TINY, "sample_tokens=0"]
    run(*tiny, "--steps", "10", "decay_steps=5", "--run-dir", straight)
    check_metrics_and_config(straight)
    run(*tiny, "--steps", "5", "--run-dir", halves)
    shutil.copytree(halves, other_mesh)
    run(*tiny, "--steps", "10", "--run-dir", halves, "--resume")
    reference, resumed = losses(straight), losses(halves)
    assert sorted(resumed) == list(range(1, 11))
    for step in range(1, 11):
        assert abs(resumed[step] - reference[step]) <= 1e-6, (step, resumed[step], reference[step])
    final_lr = 6e-4 * 0.1  # the tiny preset's lr × min_lr_ratio
    assert [r["lr"] for r in metrics(halves)[5:]] == pytest.approx([final_lr] * 5)
    assert json.load(open(os.path.join(halves, "config.json")))["optimizer"]["decay_steps"] == 5
    moved = [a if a != "data=2,tensor=4" else "data=2,fsdp=2,tensor=2" for a in tiny]
    out = run(*moved, "--steps", "7", "--run-dir", other_mesh, "--resume")
    assert "data=2 × fsdp=2 × tensor=2" in out.stdout
    for step in (6, 7):  # same model and data; only the reduction order differs
        assert abs(losses(other_mesh)[step] - reference[step]) <= 1e-4 * abs(reference[step])


@pytest.mark.slow
def test_sigterm_saves_a_restorable_checkpoint(tmp_path):
    """The run is stopped long before its end, so it compiles no end-of-run sample; its schedule (decay_steps=5) is
    the one test_metrics_and_resume_with_the_same_losses_on_any_mesh's runs compiled in this process, whose train
    step and evaluation the command loads from the tests' compilation cache (`commands.env`)."""
    run_dir = str(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "jaxseq.train", *TINY, "--steps", "100000",
                             "--checkpoint-every", "100000", "--eval-every", "100000", "--run-dir", run_dir,
                             "decay_steps=5", "sample_tokens=0"],
                            cwd=ROOT, env=env(cache=True), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    path = os.path.join(run_dir, "metrics.jsonl")
    deadline = time.time() + 180
    while time.time() < deadline and not (os.path.exists(path) and len(open(path).readlines()) >= 3):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]  # 128 + 15: stopped, not finished
    assert "SIGTERM: saved a checkpoint" in out and "Traceback" not in err
    step = max(losses(run_dir))
    gen = python_m("jaxseq.generate", "--run-dir", run_dir, "--prompt", "ab", "--max-tokens", "5", timeout=120,
                   cache=True)
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert gen.stdout.startswith(f"# step {step}\nab")


@pytest.mark.slow  # 7 s; test_step_loop.py holds the loop's stop on a non-finite step in the fast tier
def test_non_finite_loss_stops_with_the_step(tmp_path):
    out = run(*TINY, "--steps", "20", "--lr", "1e30", "--warmup-steps", "0", "--checkpoint-every", "1",
              "--run-dir", str(tmp_path), "sample_tokens=0", check=False)  # stopped: no end-of-run sample compiled
    assert out.returncode == 1
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("error: non-finite loss") and "at step" in line, out.stderr[-2000:]
    assert "last good checkpoint" in line


def test_non_finite_gradients_under_a_finite_loss_stop_too():
    from jaxseq.training.loop import non_finite

    assert non_finite(3, 2.5, 0.7, 2) is None
    message = non_finite(3, 2.5, float("inf"), 2)
    assert message.startswith("non-finite gradient norm at step 3") and "kept (step 2)" in message
    assert non_finite(1, float("nan"), float("nan"), None).endswith("kept (none written)")


def test_a_failed_execution_is_one_line():
    """Out of memory, or a collective whose peer died: the runtime's first line, not XLA's stack."""
    import jax

    from jaxseq.train import runtime_failure

    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 80.00GiB\n  stack …")
    assert runtime_failure(oom, 1) == "the XLA runtime failed: RESOURCE_EXHAUSTED: Out of memory allocating 80.00GiB"
    peer = jax.errors.JaxRuntimeError("UNKNOWN: Gloo all-reduce failed: Connection reset by peer\n…")
    line = runtime_failure(peer, 2)
    assert "Connection reset by peer" in line and "another process died" in line and "\n" not in line


@pytest.mark.parametrize("args,message", [
    (["--data", "/nonexistent/*.txt"], "matches no files"),
    (["--run-dir", "/proc/jaxseq-cannot-write"], "is not writable"),
    (["--mesh", "data=3,tensor=4"], "does not equal the device count 8"),
    (["--remat", "selctive"], "remat='selctive' is not a registered policy"),
    (["--mesh", "data=1,tensor=8", "heads=4"], "tensor=8 does not divide heads=4"),
    (["hiden=3"], "unknown config field 'hiden'"),
    (["--batch-size", "7"], "data=2 does not divide batch_size=7"),
    (["dropout=much"], "dropout='much' is not a valid float"),
    (["--steps", "abc"], "argument --steps: invalid int value: 'abc'"),
    (["--lr", "-1"], "lr=-1.0 must be ≥ 0"),
    pytest.param(["--seq-len", "100000"], "the compiled train step needs",
                 marks=pytest.mark.slow),  # 6.5 s: compiles it
    (["--virtual-stages", "2"], "virtual_stages=2 needs a pipeline, and pipe=1"),
    (["--layer-loop", "unrolled"], "layer_loop='unrolled' on CPU: XLA:CPU does not keep a remat policy"),
    (["--layer-loop", "while"], "layer_loop='while' is not valid; valid: scan, unrolled"),
    (["--record-autotune", "at.textproto"], "record_autotune='at.textproto': XLA autotunes GEMMs on GPUs only; "
                                            "this run's devices are cpu"),
    (["--fp8", "--dtype", "float32"], "fp8=True with dtype='float32': FP8 GEMMs run in a bfloat16 model"),
])
def test_bad_input_gives_one_clear_line(args, message, tmp_path):
    out = run(*TINY, "--steps", "1", "--run-dir", str(tmp_path / "run"), *args, check=False)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [out.stderr.strip().splitlines()[-1]]
    assert message in out.stderr and out.stderr.startswith("error: "), out.stderr[-2000:]


def test_an_unquoted_data_glob_the_shell_expanded_says_to_quote_it(tmp_path):
    """`--data notes/*.md` unquoted reaches the command as `--data notes/a.md notes/b.md notes/c.md`: the files after
    the first are taken for key=value overrides, and the one line says to quote the glob."""
    names = [tmp_path / f"{c}.md" for c in "abc"]
    for name in names:
        name.write_text("notes\n")
    out = run(*TINY, "--steps", "1", "--run-dir", str(tmp_path / "run"), "--data", *map(str, names), check=False)
    assert out.returncode == 2 and out.stderr == (
        f"error: override '{names[1]}' is not key=value: it is a file, as when the shell expands an unquoted --data "
        f"glob into {names[0]} {names[1]} …; quote the glob (--data '{tmp_path}/*.md')\n"), out.stderr


def test_without_a_gpu_the_cuda_plugin_is_told_to_stay_out():
    """With JAX's CUDA plugin installed (for `plan --target`) on a machine without an NVIDIA driver, train asks JAX for
    the CPU before its backends start: the plugin then skips its check of the CUDA libraries, which failed with a
    17-line "Jax plugin configuration error" traceback before every run. A platform the user chose (JAX_PLATFORMS),
    a driver, or no plugin: nothing is asked. (The plugin is not installed here: the decision alone is tested.)"""
    from jaxseq.train import cpu_without_a_gpu, gpu_here

    assert cpu_without_a_gpu(None, plugin=True, driver=False)
    assert cpu_without_a_gpu("", plugin=True, driver=False)
    assert not cpu_without_a_gpu("cuda", plugin=True, driver=False)
    assert not cpu_without_a_gpu(None, plugin=True, driver=True)
    assert not cpu_without_a_gpu(None, plugin=False, driver=False)
    plugin, driver = gpu_here()
    assert isinstance(plugin, bool) and isinstance(driver, bool) and (plugin or not driver)


def test_a_value_of_the_default_mesh_says_so(tmp_path):
    """No --mesh: the 8 simulated devices' default data=2 × tensor=4 does not divide 6 heads; the one line says the
    mesh was the default, not asked for, and names one that works (docs/training.md's YAML example gives it)."""
    out = run("--preset", "tiny", "--host-devices", "8", "--steps", "1", "--run-dir", str(tmp_path / "run"),
              "heads=6", "hidden=96", check=False)
    assert out.returncode == 2 and out.stderr == (
        "error: tensor=4 does not divide heads=6: the mesh data=2,tensor=4 is the default on 8 simulated CPU devices, "
        "not one you asked for; set one with --mesh (e.g. --mesh data=4,tensor=2)\n"), out.stderr
    asked = run("--preset", "tiny", "--host-devices", "8", "--steps", "1", "--run-dir", str(tmp_path / "run"),
                "--mesh", "data=2,tensor=4", "heads=6", "hidden=96", check=False)
    assert asked.returncode == 2 and asked.stderr == "error: tensor=4 does not divide heads=6\n", asked.stderr


def test_empty_data_and_incompatible_resume(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    out = run(*TINY, "--steps", "1", "--run-dir", str(tmp_path / "a"), "--data", str(empty), check=False)
    assert out.returncode == 2 and "is empty" in out.stderr
    run(*TINY, "--steps", "2", "--run-dir", str(tmp_path / "b"))
    out = run(*TINY, "--steps", "4", "--run-dir", str(tmp_path / "b"), "--resume", "layers=3", check=False)
    assert out.returncode == 2 and "cannot resume" in out.stderr and "layers=2 (saved) vs 3" in out.stderr
    out = run(*TINY, "--steps", "4", "--run-dir", str(tmp_path / "b"), check=False)
    assert out.returncode == 2 and "already holds checkpoints" in out.stderr


def test_empty_text_is_refused_when_tokenized_and_empty_token_files_when_trained_on(tmp_path):
    """`python -m jaxseq.data` on an empty file wrote a 0-token split and exited 0, and training on it ended in
    a traceback (np.memmap: "cannot mmap an empty file"): one line and exit status 2 at each."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    out = command(data_command.main, "--input", str(empty), "--output", str(tmp_path / "e"), check=False)
    assert out.returncode == 2 and out.stderr == (f"error: --input {str(empty)!r}: the file is empty: no text to "
                                                  "tokenize\n")
    assert not list(tmp_path.glob("e.*"))
    (tmp_path / "text.txt").write_text("def f(x):\n    return x + 1\n" * 50)
    prefix = str(tmp_path / "tok")
    command(data_command.main, "--input", str(tmp_path / "text.txt"), "--output", prefix)
    open(prefix + ".val.bin", "wb").close()  # as an old jaxseq.data wrote it
    out = run(*TINY, "--steps", "1", "--data", prefix, "--run-dir", str(tmp_path / "run"), check=False)
    assert out.returncode == 2 and out.stderr == (f"error: data={prefix!r}: {prefix}.val.bin holds no tokens (python "
                                                  "-m jaxseq.data writes both splits of non-empty text)\n"), out.stderr


@pytest.mark.slow  # 8 s: two commands; the token files' reading: tests/test_data.py in the fast tier
def test_train_and_generate_on_token_files(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 100)
    prefix = str(tmp_path / "tok")
    command(data_command.main, "--input", str(src), "--output", prefix, "--vocab-size", "320")
    run_dir = str(tmp_path / "run")
    out = run(*TINY, "--steps", "2", "--data", prefix, "--run-dir", run_dir)
    # The end-of-run sample continues the first line of a validation document (one of the m*.py files).
    assert re.search(r"\nsample \(prompt: the start of a validation document\):\ndef f\d\(x\):\n",
                     out.stdout), out.stdout
    config = json.load(open(os.path.join(run_dir, "config.json")))
    assert 256 < config["model"]["vocab_size"] <= 320 and config["train"]["tokenizer"].endswith("tok.tokenizer.json")
    gen = command(generate_command.main, "--run-dir", run_dir, "--prompt", "def f1", "--max-tokens", "4")
    assert gen.returncode == 0 and gen.stdout.startswith("# step 2\ndef f1"), gen.stderr[-2000:]
    # An empty prompt under the BPE: the start of a document as the tokenizer encodes it, not byte id 10.
    gen = command(generate_command.main, "--run-dir", run_dir, "--prompt", "", "--max-tokens", "4")
    assert gen.returncode == 0 and gen.stdout.startswith("# step 2\n"), gen.stderr[-2000:]


def test_config_precedence_preset_yaml_flags_overrides(tmp_path):
    """preset < --config FILE.yaml < flags < trailing key=value; every flag lands in its field."""
    from jaxseq.train import build_parser, configs_from_args

    path = tmp_path / "run.yaml"
    path.write_text("preset: tiny\nmodel: {layers: 6, hidden: 128}\noptimizer: {lr: 0.002}\n"
                    "train: {batch_size: 64, eval_every: 250}\nseed: 7\n")
    args = build_parser().parse_intermixed_args(
        ["--config", str(path), "--lr", "0.003", "--micro-batch-size", "16", "--attention", "fused",
         "--dtype", "float32", "--peak-tflops", "989", "--remat", "lean", "--steps", "40", "hidden=96",
         "optimizer.b2=0.99"])
    configs, mesh, sp = configs_from_args(args)
    model, opt, train = configs["model"], configs["optimizer"], configs["train"]
    assert (model.heads, model.layers, model.hidden) == (8, 6, 96)  # tiny, YAML, then key=value
    assert (model.attention, model.dtype) == ("fused", "float32")
    assert (opt.lr, opt.b2, opt.decay_steps) == (0.003, 0.99, 40)  # flag over YAML; cosine over the run
    assert (train.batch_size, train.micro_batch_size, train.eval_every, train.seed) == (64, 16, 250, 7)
    assert (train.peak_tflops, train.remat, train.steps) == (989.0, "lean", 40)
    assert mesh is None and sp is None  # resolved later, once the devices are known


@pytest.mark.parametrize("name", ["tiny", "gpt2-124m", "stdlib-bytes"])
def test_a_preset_named_in_the_yaml_file_is_the_same_run_as_the_flag(tmp_path, name):
    """`--preset X` and a --config file holding `preset: X` resolve to the same RunConfig: the YAML
    form kept the default run's optimizer (lr 2e-3, 50 warmup steps), 800 steps and float32."""
    from jaxseq.train import build_parser, resolve

    (tmp_path / "run.yaml").write_text(f"preset: {name}\n")
    (tmp_path / "text.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    common = ["--data", str(tmp_path / "text.txt"), "--run-dir", str(tmp_path / "run"), "--host-devices", "8"]
    by_flag, _ = resolve(build_parser().parse_intermixed_args(["--preset", name, *common]))
    by_yaml, _ = resolve(build_parser().parse_intermixed_args(["--config", str(tmp_path / "run.yaml"), *common]))
    assert by_yaml == by_flag
    # Both given: the flag wins, as flags win over the file everywhere else.
    other = "tiny" if name != "tiny" else "gpt2-124m"
    both, _ = resolve(build_parser().parse_intermixed_args(
        ["--preset", other, "--config", str(tmp_path / "run.yaml"), *common]))
    assert both == resolve(build_parser().parse_intermixed_args(["--preset", other, *common]))[0]


def test_resume_keeps_the_saved_run_and_changes_only_what_is_named():
    """A resume starts from the saved configs and replaces only the fields given (a flag, the YAML file or a
    key=value); a preset named asks for its architecture (which the resume then compares with the saved one)."""
    from jaxseq.config import ModelConfig, OptimizerConfig, ParallelConfig, TrainConfig, replace
    from jaxseq.train import build_parser, configs_from_args
    from jaxseq.training.resume import resumed_configs

    saved = {"model": ModelConfig(hidden=64, heads=8, layers=2, vocab_size=257, seq_len=64, dtype="float32"),
             "optimizer": OptimizerConfig(lr=2e-3, warmup_steps=50, decay_steps=800),
             "train": TrainConfig(steps=800, batch_size=16, micro_batch_size=8, data="notes/*.md", run_dir="old"),
             "parallel": ParallelConfig(data=4, tensor=2, sequence_parallel=True, distributed_optimizer=True)}
    resume = lambda *argv: resumed_configs(saved, configs_from_args(build_parser().parse_intermixed_args(
        ["--run-dir", "runs/x", "--resume", *argv]))[0])
    kept = resume()
    assert {k: kept[k] for k in saved} == {**saved, "train": replace(saved["train"], run_dir="runs/x", resume=True)}
    changed = resume("--steps", "1500", "--lr", "1e-3", "dropout=0.2", "--micro-batch-size", "4")
    assert changed["optimizer"] == replace(saved["optimizer"], lr=1e-3)  # decay_steps: the original run's
    assert changed["model"] == replace(saved["model"], dropout=0.2)
    assert (changed["train"].steps, changed["train"].micro_batch_size, changed["train"].batch_size,
            changed["train"].data) == (1500, 4, 16, "notes/*.md")
    assert changed["parallel"] == saved["parallel"]
    named = resume("--preset", "gpt2-124m")["model"]
    assert (named.hidden, named.layers, named.vocab_size, named.dtype) == (768, 12, 257, "float32")


def test_resume_resolves_the_saved_run(tmp_path, capsys):
    """`--resume` alone resolves to the run saved in RUN/config.json (its data, batch sizes, mesh, distributed
    optimizer, model), not to the default preset's; a flag changes what it names and one line says so; another
    model is refused in one line. Before, data, steps, batch sizes and mesh came back as the defaults."""
    from jaxseq.config import OptimizerConfig, ParallelConfig, RunConfig, TrainConfig, replace
    from jaxseq.presets import preset
    from jaxseq.train import build_parser, resolve
    from jaxseq.training import rundir

    text = tmp_path / "notes.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 300)
    run_dir = str(tmp_path / "run")
    saved = RunConfig(model=replace(preset("tiny"), vocab_size=257, dtype="float32", dropout=0.0),
                      parallel=ParallelConfig(data=4, tensor=2, sequence_parallel=True, distributed_optimizer=True),
                      optimizer=OptimizerConfig(lr=1e-3, warmup_steps=5, decay_steps=200),
                      train=TrainConfig(steps=200, batch_size=16, micro_batch_size=8, data=str(text), run_dir=run_dir,
                                        log_every=10, sample_tokens=0))
    os.makedirs(os.path.join(run_dir, "checkpoints", "1"))  # a step to resume (resolve reads none of it)
    rundir.write_config(run_dir, saved)
    resume = lambda *argv: resolve(build_parser().parse_intermixed_args(["--run-dir", run_dir, "--resume", *argv]))[0]
    kept = resume()
    assert replace(kept, model=replace(kept.model, matmul="einsum")) == \
        replace(saved, train=replace(saved.train, resume=True))
    assert capsys.readouterr().out == f"resume: the run as saved in {run_dir}/config.json (nothing changed)\n"
    moved = resume("--mesh", "data=2,tensor=4", "--steps", "300", "--no-distributed-optimizer")
    assert (moved.parallel.data, moved.parallel.tensor, moved.parallel.sequence_parallel) == (2, 4, True)
    assert (moved.train.batch_size, moved.train.micro_batch_size, moved.optimizer) == (16, 8, saved.optimizer)
    assert capsys.readouterr().out == (f"resume: the run as saved in {run_dir}/config.json, changed as asked: mesh "
                                       "data=4 × tensor=2 → data=2 × tensor=4, steps 200 → 300, "
                                       "distributed_optimizer True → False\n")
    for argv, message in ((["--preset", "gpt2-124m"], "hidden=64 (saved) vs 768"),
                          (["layers=3"], "layers=2 (saved) vs 3")):
        assert main(["--run-dir", run_dir, "--resume", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: cannot resume: the checkpoint's model differs: ") and message in err, err


def test_resume_drops_what_the_new_mesh_cannot_use_and_restores_no_launch_setting(tmp_path, capsys):
    """A zb-h1 run and an interleaved one, launched on a GPU machine with --record-autotune and --peak-tflops,
    resumed on this CPU with `--mesh data=2,tensor=4 --resume` and nothing else: the schedule (and the virtual
    stages) that config.json restored are dropped, as the mesh has no pipeline, and the resume line says so; the
    launch's own settings (record_autotune, peak_tflops, host_devices) are not restored. Before, the first was
    refused with "leave the schedule … at their defaults", the second with "leave --record-autotune out". A
    schedule this launch gives is the user's: still refused in one line."""
    from jaxseq.config import OptimizerConfig, ParallelConfig, RunConfig, TrainConfig, replace
    from jaxseq.presets import preset
    from jaxseq.train import build_parser, resolve
    from jaxseq.training import rundir

    text = tmp_path / "notes.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 300)
    tiny = replace(preset("tiny"), vocab_size=257, dtype="float32", dropout=0.0)
    pipe = ParallelConfig(pipe=2, data=2, tensor=2, sequence_parallel=True)
    pipelines = {"zb-h1": (tiny, replace(pipe, schedule="zb-h1")),
                 "interleaved": (replace(tiny, layers=4), replace(pipe, schedule="interleaved", virtual_stages=2))}
    for schedule, (model, parallel) in pipelines.items():
        run_dir = str(tmp_path / schedule)
        train = TrainConfig(steps=200, batch_size=16, micro_batch_size=4, data=str(text), run_dir=run_dir,
                            sample_tokens=0, record_autotune="at.textproto", peak_tflops=989.0, host_devices=16)
        os.makedirs(os.path.join(run_dir, "checkpoints", "1"))  # a step to resume (resolve reads none of it)
        rundir.write_config(run_dir, RunConfig(model=model, parallel=parallel, optimizer=OptimizerConfig(),
                                               train=train))
        argv = ["--run-dir", run_dir, "--resume", "--mesh", "data=2,tensor=4"]
        run = resolve(build_parser().parse_intermixed_args(argv))[0]
        assert (run.parallel.schedule, run.parallel.virtual_stages, run.parallel.sequence_parallel) == ("1f1b", 1, True)
        assert (run.train.record_autotune, run.train.peak_tflops, run.train.host_devices) == (None, None, 8)
        dropped = f"schedule {schedule!r} (no pipeline)" + (", virtual_stages 2 (no pipeline)" if schedule ==
                                                           "interleaved" else "")
        assert capsys.readouterr().out == (
            f"resume: the run as saved in {run_dir}/config.json, changed as asked: mesh pipe=2 × data=2 × "
            f"tensor=2 → data=2 × tensor=4; dropped, as the mesh data=2 × tensor=4 cannot use them: {dropped}\n")
        assert main([*argv, "--schedule", schedule]) == 2
        assert "needs a pipeline, and pipe=1" in capsys.readouterr().err


def test_a_failed_resume_creates_nothing(tmp_path, capsys):
    """`--resume` where there is no checkpoint (a directory that does not exist, or one of the checkout's own, as
    `--run-dir docs --resume` was) is one line, and leaves no directory behind: it created the run directory and
    RUN/checkpoints/."""
    (tmp_path / "docs").mkdir()
    errors = {}
    for run_dir in (tmp_path / "nothing", tmp_path / "docs"):
        assert main([*TINY, "--run-dir", str(run_dir), "--resume"]) == 2
        errors[run_dir] = capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["docs"] and not os.listdir(tmp_path / "docs")
    assert errors == {run_dir: f"error: --resume: no checkpoint in {run_dir}/checkpoints: nothing to resume (pass the "
                               "--run-dir of a run that saved one, or leave --resume out to start a run there)\n"
                      for run_dir in errors}


def test_resume_restores_the_run_and_says_what_changes(tmp_path):
    """As a user meets it: a run on its own text, resumed with `--resume --steps 3` alone (no preset, no
    data): the same run, one line naming the one change; config.json is the run's, not the defaults' (it said
    `"data": null` after such a resume). On the finished run a bare `--resume` says so; fewer steps than done
    are refused in one line."""
    text = tmp_path / "notes.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 300)
    run_dir = str(tmp_path / "run")
    run(*TINY, "--data", str(text), "--steps", "2", "--run-dir", run_dir)
    config = os.path.join(run_dir, "config.json")
    saved = json.load(open(config))
    out = run("--run-dir", run_dir, "--resume", "--steps", "3")
    assert out.stdout.splitlines()[0] == f"resume: the run as saved in {config}, changed as asked: steps 2 → 3"
    assert f"{text} (" in out.stdout and "steps 2→3" in out.stdout
    resumed = json.load(open(config))
    assert resumed == {**saved, "train": {**saved["train"], "steps": 3, "resume": True}}
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3]
    out = run("--run-dir", run_dir, "--resume")
    assert out.stdout.splitlines()[-1] == (f"{run_dir} has finished its 3 steps: nothing to train; to continue it, "
                                           "--resume --steps N with N > 3")
    assert json.load(open(config)) == resumed
    out = run("--run-dir", run_dir, "--resume", "--steps", "2", check=False)
    assert out.returncode == 2 and out.stderr.startswith("error: --resume: the newest checkpoint") \
        and "is at step 3, past steps=2" in out.stderr and out.stderr.count("\n") == 1


def test_ctrl_c_during_start_up_is_one_line_and_status_130(tmp_path):
    """Ctrl-C while the run starts (here while it compiles, after its first line): one line and exit status
    130, where it was a 61-line KeyboardInterrupt traceback and a segmentation fault (exit 139). On a loaded
    machine this process may send the signal only once the steps have begun (its programs come from the
    compilation cache): then the run saves and stops with 130 all the same, and says so on stdout, and the
    steps are many so that it cannot finish first."""
    proc = subprocess.Popen([sys.executable, "-m", "jaxseq.train", *TINY, "--steps", "1000", "--run-dir",
                             str(tmp_path)], cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    first = proc.stdout.readline()  # the banner, printed before the step is compiled
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert first.startswith("jaxseq: ") and proc.returncode == 130, (first, err[-2000:])
    if "saved a checkpoint" in out:  # the signal came after the first step
        assert "Traceback" not in err and "SIGINT: saved a checkpoint at step" in out, (out[-2000:], err[-2000:])
    else:
        assert err == "error: SIGINT: stopped before the first step; nothing to save\n", err[-2000:]


def test_extending_a_finished_run_stays_at_the_final_learning_rate():
    from jaxseq.training import train_step as T
    from jaxseq.config import OptimizerConfig

    schedule = T.learning_rate_schedule(OptimizerConfig(lr=2e-3, warmup_steps=50, decay_steps=800))
    assert [float(schedule(s)) for s in (800, 1000, 1499)] == pytest.approx([2e-4] * 3)


def test_explicit_fields_are_recorded():
    from jaxseq.train import build_parser, configs_from_args

    configs, _, _ = configs_from_args(build_parser().parse_intermixed_args(["--lr", "1e-3", "b2=0.99", "--steps", "9"]))
    assert {"optimizer.lr", "optimizer.b2", "train.steps"} <= configs["explicit"]
    assert "optimizer.decay_steps" not in configs["explicit"] and configs["optimizer"].decay_steps == 9


@pytest.mark.parametrize("content, message", [
    (b"model: {hidden: \xff\xfe}\n", "is not UTF-8 text"),
    (b"model: {hidden: 64\n", "is not valid YAML"),
    (b"optimizer:\n  lr: 1e-3\n bad: indent\n", "is not valid YAML"),
])
def test_an_unreadable_config_file_is_one_line(tmp_path, capsys, content, message):
    from jaxseq.train import main

    path = tmp_path / "run.yaml"
    path.write_bytes(content)
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --config") and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("content, message", [
    ("model: {hiden: 64}\n",
     "unknown config field model.hiden; valid model fields: attention, document_mask, dropout, "),
    ("optimizer:\n  learning_rate: 1e-3\n", "unknown config field optimizer.learning_rate; valid optimizer fields: "
                                            "b1, b2, clip_norm, decay_steps, eps, lr, "),
    ("modle: {hidden: 64}\n", "unknown section 'modle'; valid: model, optimizer, train, parallel (or flat field "),
])
def test_a_typo_in_the_yaml_file_names_the_valid_fields(tmp_path, capsys, content, message):
    """A misspelt field under a section (`model: {hiden: …}`) is one line naming the section's valid fields, a
    misspelt section the sections; before, `unknown config field model.'hiden'` alone."""
    from jaxseq.train import main

    path = tmp_path / "run.yaml"
    path.write_text(content)
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("flag, message", [
    (["--lr", "-1"], "lr=-1.0 must be ≥ 0"),
    (["--weight-decay", "-0.1"], "weight_decay=-0.1 must be ≥ 0"),
    (["--warmup-steps", "-5"], "warmup_steps=-5 must be an integer ≥ 0"),
    (["--clip-norm", "0"], "clip_norm=0.0 must be > 0"),
    (["optimizer.b1=1.0"], "b1=1.0 must be in [0, 1)"),
    (["optimizer.b2=-0.5"], "b2=-0.5 must be in [0, 1)"),
    (["optimizer.eps=0"], "eps=0.0 must be > 0"),
    (["min_lr_ratio=2"], "min_lr_ratio=2.0 must be in [0, 1]"),
    (["decay_steps=0"], "decay_steps=0 must be an integer ≥ 1"),
    (["--lr", "nan"], "lr=nan must be ≥ 0"),
    (["--lr", "-1e-3"], "lr=-0.001 must be ≥ 0"),  # a value, not an option ("expected one argument")
    (["--lr", "-.5"], "lr=-0.5 must be ≥ 0"),
])
def test_optimizer_ranges_are_checked_at_the_edge(capsys, flag, message):
    from jaxseq.train import main

    assert main(["--preset", "tiny", *flag]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {message}\n", err


def test_a_step_that_cannot_fit_is_refused_with_both_numbers():
    from jaxseq.training import aot
    from jaxseq.config import ConfigError

    aot.check_fits(2 * 2**30, 3 * 2**30)
    aot.check_fits(2 * 2**30, None)  # the backend reports no limit: nothing to compare
    with pytest.raises(ConfigError) as e:
        aot.check_fits(92 * 2**40, 80 * 2**30)
    line = str(e.value)
    assert "94208.00 GiB per device" in line and "80.00 GiB" in line and "\n" not in line
    assert "--micro-batch-size" in line and "--remat full" in line and "tensor" in line


def test_record_autotune_asks_xla_for_the_train_steps_gemm_choices(tmp_path, monkeypatch):
    """`--record-autotune FILE` on a GPU: the train step compiles with XLA's `xla_gpu_dump_autotune_results_to` set
    to FILE's absolute path (what `plan --target … --autotune-results FILE` loads), on the main process only; without
    the flag, no option. (On CPU the flag is refused in one line: test_bad_input_gives_one_clear_line.)"""
    from types import SimpleNamespace

    from jaxseq.training import loop

    session = lambda path: SimpleNamespace(run=SimpleNamespace(train=SimpleNamespace(record_autotune=path)))
    monkeypatch.chdir(tmp_path)
    assert loop.recording(session("at.textproto")) == {
        "xla_gpu_dump_autotune_results_to": str(tmp_path / "at.textproto")}
    assert loop.recording(session(None)) is None
    monkeypatch.setattr(loop.distributed, "is_main_process", lambda: False)
    assert loop.recording(session("at.textproto")) is None
