"""The commands the documentation gives run as written, without pinning its prose: README's first code block
is the set-up + train and the set-up + test command (`.ci/run` runs the second: tests/test_install.py), and
every `python -m jaxseq.<command>` in README.md and docs/*.md (code blocks and inline code) parses with that
command's own argument parser, built in this process; nothing is trained, planned or converted."""

import glob
import importlib
import os
import re
import shlex

import pytest

from jaxseq import cli
from jaxseq import train as train_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP = "python3 -m venv .venv && . .venv/bin/activate && pip install -r "
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def _read(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def _shell_lines(text):
    """Each command line of the ```bash blocks (continuation lines joined), and each inline `python -m … --flag`."""
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        yield from block.replace("\\\n", " ").splitlines()
    # Inline code with flags is a command to run; without (`python -m jaxseq.data`), a name in the prose.
    yield from (span for span in re.findall(r"(?<!`)`(python -m jaxseq\.\w+[^`]*)`", text)
                if " -" in span.split("jaxseq.", 1)[1])


def _invocations():
    """(file, command, argv) of every `python -m jaxseq.<command>` the documentation gives."""
    found = []
    for name in DOCS:
        for line in _shell_lines(_read(name)):
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True  # words as a shell splits them; `#` starts a comment
            words = list(lexer)
            starts = [i for i in range(len(words) - 2) if words[i].startswith("python") and words[i + 1] == "-m"
                      and words[i + 2].startswith("jaxseq.")]
            for i in starts:
                end = next((j for j in range(i + 3, len(words)) if words[j] in ("&&", "||", ";", "|", "&")), len(words))
                found.append((name, words[i + 2].split(".", 1)[1], words[i + 3:end]))
    return found


INVOCATIONS = _invocations()


def test_the_first_block_is_setup_and_train_then_setup_and_test():
    block = re.search(r"```bash\n(.*?)```", _read("README.md"), re.S).group(1)
    train, test = [line for line in block.splitlines() if line.strip()]
    assert train == SETUP + "requirements.txt && python -m jaxseq.train"
    assert test.startswith(SETUP + "requirements-test.txt && python -m pytest ") and test.endswith(" tests")


def test_the_docs_give_commands_of_every_kind():
    assert {command for _, command, _ in INVOCATIONS} >= {"train", "plan", "generate", "convert", "data", "schedule"}
    assert {name for name, _, _ in INVOCATIONS} >= {"README.md", "docs/training.md", "docs/parallelism.md",
                                                    "docs/planning.md", "docs/huggingface.md", "docs/clusters.md"}


@pytest.mark.parametrize("name,command,argv", INVOCATIONS,
                         ids=[f"{n}:{c}:{' '.join(a)[:60]}" for n, c, a in INVOCATIONS])
def test_each_command_parses(name, command, argv, monkeypatch):
    """The command's own `main(argv)`, stopped where it would start working (`cli.run`, every command's body);
    argparse's errors exit before that. train's key=value overrides must name config fields, and its preset
    must exist (checked without reading any file the command names)."""
    module = importlib.import_module(f"jaxseq.{command}")
    ran = []
    monkeypatch.setattr(cli, "run", lambda body: ran.append(body) or 0)
    try:
        code = module.main(list(argv))
    except SystemExit as e:  # argparse: --help exits 0, a bad flag 2
        code = e.code
    assert code == 0, f"{name}: python -m jaxseq.{command} {shlex.join(argv)}"
    assert ran or "--help" in argv or "-h" in argv
    if command == "train" and "--help" not in argv:
        args = train_command.build_parser().parse_intermixed_args(argv)
        if not args.config and not args.init_from:
            train_command.configs_from_args(args)


def _run_dir(argv):
    """The `--run-dir` a train command names (None: the default, runs/default)."""
    for i, word in enumerate(argv):
        if word == "--run-dir":
            return argv[i + 1]
        if word.startswith("--run-dir="):
            return word.split("=", 1)[1]
    return None


def test_each_new_train_run_has_a_run_directory_of_its_own():
    """Run one after another as written, no train command collides with an earlier run's checkpoints (`already
    holds checkpoints`): the default run alone uses the default directory (no flags at all), every other command
    that starts a run names a `--run-dir`, and two commands share one only where they are the same command
    (README and a doc giving it both) or the later one resumes it."""
    owners = {}
    for name, command, argv in INVOCATIONS:
        if command != "train" or "--help" in argv or "--resume" in argv:
            continue
        run_dir = _run_dir(argv)
        assert run_dir is not None or argv == [], f"{name}: python -m jaxseq.train {shlex.join(argv)} needs --run-dir"
        owners.setdefault(run_dir, set()).add(shlex.join(argv))
    # docs/clusters.md: the processes of one run (and srun / mpirun launching the same job) share its directory.
    shared = {d: commands for d, commands in owners.items() if len(commands) > 1 and not d.startswith("/shared/")}
    assert not shared, shared


def test_the_yaml_example_is_valid_as_written(tmp_path):
    """docs/training.md's YAML file with the command its first line gives: resolved and validated as the command
    would (devices, mesh, data, every check before the first compile), in this process; nothing is trained."""
    block = re.search(r"```yaml\n(.*?)```", _read("docs/training.md"), re.S).group(1)
    command = re.match(r"# run\.yaml: (python -m jaxseq\.train .*)\n", block).group(1)
    (tmp_path / "run.yaml").write_text(block)
    argv = shlex.split(command)[3:]
    assert argv[:2] == ["--config", "run.yaml"] and _run_dir(argv)
    argv[1], argv[argv.index("--run-dir") + 1] = str(tmp_path / "run.yaml"), str(tmp_path / "run")
    run, _ = train_command.resolve(train_command.build_parser().parse_intermixed_args(argv))
    assert (run.model.heads, run.model.layers, run.train.steps) == (6, 6, 2000)


def test_the_own_data_example_runs_on_a_cpu_or_says_it_needs_a_gpu():
    """README's "Your own data": a train command on the token files with the default model (which runs on the
    CPU's simulated devices), and the GPT-2 124M one marked as a GPU command on its own line."""
    block = re.search(r"## Your own data\n+```bash\n(.*?)```", _read("README.md"), re.S).group(1)
    trains = [line for line in block.splitlines() if "python -m jaxseq.train --data data/corpus" in line]
    assert any("--preset" not in line for line in trains), trains
    assert all("GPU" in line.split("#", 1)[-1] for line in trains if "--preset gpt2" in line), trains


def test_what_the_readmes_commands_write_is_ignored_by_git():
    """The directories README's own commands write into (the data command's --output, train's --run-dir, convert's
    output) are in .gitignore: `data/` and `hf/` were not, and a user following README had them in `git status`."""
    ignored = {line.strip().strip("/") for line in _read(".gitignore").splitlines() if line.strip().endswith("/")}
    written = set()
    for name, command, argv in INVOCATIONS:
        if name != "README.md":
            continue
        outputs = [argv[i + 1] for i, word in enumerate(argv[:-1]) if word in ("--output", "--run-dir")]
        if command == "convert" and argv[:1] in (["from-hf"], ["to-hf"]):
            outputs.append(argv[2])
        written |= {path.split("/")[0] for path in outputs if "/" in path and not path.startswith(("/", "~"))}
    assert {"data", "hf", "runs"} <= written, written
    assert written <= ignored, written - ignored
