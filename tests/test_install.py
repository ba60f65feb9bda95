"""The install story as README tells it: runtime and test requirements apart, CI running exactly the
README's test command, pyproject declaring what `import jaxseq.*` needs, one pinned JAX version."""

import os
import re
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_ONLY = {"pytest", "pytest-xdist", "torch", "transformers"}


def _read(name):
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def _pins(name):
    """name → version of every `name==version` line (comments and -r lines skipped)."""
    pins = {}
    for line in _read(name).splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            pkg, version = line.split("==")
            pins[pkg.lower()] = version
    return pins


def _readme_commands():
    block = re.search(r"```bash\n(.*?)```", _read("README.md"), re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_the_main_job_installs_runtime_requirements_only():
    train, test = _readme_commands()[:2]
    assert "pip install -r requirements.txt " in train and train.endswith("python -m jaxseq.train")
    assert "pip install -r requirements-test.txt " in test and "pytest" in test
    assert not TEST_ONLY & set(_pins("requirements.txt"))
    assert TEST_ONLY <= set(_pins("requirements-test.txt"))
    assert "-r requirements.txt" in _read("requirements-test.txt").splitlines()


def test_ci_runs_exactly_the_readme_test_command():
    test = _readme_commands()[1]
    ci = [line for line in _read(".ci/run").splitlines() if line.strip() and not line.startswith(("#", "set ", "cd "))]
    # The first line that installs Python packages or runs tests is it; before it, only a system package the
    # tests' processes preload where it is installed (libjemalloc2: tests/conftest.py).
    assert next(line for line in ci if "pip install" in line or "pytest" in line) == test


def test_pyproject_declares_every_runtime_requirement():
    project = tomllib.loads(_read("pyproject.toml"))["project"]
    declared = {re.split(r"[<>=\[ ]", d)[0].lower() for d in project["dependencies"]}
    # jaxlib comes with jax.
    assert set(_pins("requirements.txt")) - {"jaxlib"} == declared
    assert TEST_ONLY <= {re.split(r"[<>=\[ ]", d)[0].lower() for d in project["optional-dependencies"]["test"]}


def test_one_jax_version_everywhere():
    pins = _pins("requirements.txt")
    assert pins["jax"] == pins["jaxlib"]
    assert f'pip install -r requirements.txt "jax[cuda12]=={pins["jax"]}"' in _read("README.md")
    newest = _pins("requirements-newest.txt")
    assert newest["jax"] == newest["jaxlib"] and newest["jax"] != pins["jax"]
    # The newest pins differ from the runtime pins in JAX only (plus the test runner).
    assert {k: v for k, v in newest.items() if k not in ("jax", "jaxlib", "pytest", "pytest-xdist")} == \
        {k: v for k, v in pins.items() if k not in ("jax", "jaxlib")}


def test_the_gpu_target_plugin_is_at_each_pinned_jax_version():
    """JAX's CUDA plugin must match jaxlib exactly: the pinned one for requirements-gpu-target.txt, the newest for
    its -newest twin (.ci/run installs each after the suite it belongs to), and the GPU's own JAX (0.11.2) in
    requirements-gpu-device.txt, which pins everything else as the newest does."""
    device = _pins("requirements-gpu-device.txt")
    assert device["jax"] == device["jaxlib"] == "0.11.2"
    assert {k: v for k, v in device.items() if k not in ("jax", "jaxlib")} == {
        k: v for k, v in {**_pins("requirements-newest.txt"), **_pins("requirements-gpu-target-newest.txt")}.items()
        if k not in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt")} | {
        "jax-cuda12-plugin": "0.11.2", "jax-cuda12-pjrt": "0.11.2"}
    for runtime, target in (("requirements.txt", "requirements-gpu-target.txt"),
                            ("requirements-newest.txt", "requirements-gpu-target-newest.txt"),
                            ("requirements-gpu-device.txt", "requirements-gpu-device.txt")):
        jax_version, plugin = _pins(runtime)["jax"], _pins(target)
        assert plugin["jax-cuda12-plugin"] == plugin["jax-cuda12-pjrt"] == jax_version, target
        assert f"pip install -r {target}" in _read(".ci/run")
        # Installed alone (docs/planning.md's `pip install -r requirements-gpu-target.txt`), it brings its jax too.
        assert runtime == target or f"-r {runtime}" in _read(target).splitlines(), target


def _imported_modules(folder):
    """Top-level modules every .py under `folder` imports (import x / from x import …)."""
    found = set()
    for base, _, names in os.walk(os.path.join(ROOT, folder)):
        for name in (n for n in names if n.endswith(".py")):
            text = _read(os.path.relpath(os.path.join(base, name), ROOT))
            found |= set(re.findall(r"^\s*(?:import|from)\s+([A-Za-z_]\w*)", text, re.M))
    return found


def test_matplotlib_is_the_experiments_own_requirement():
    """Only experiments/ imports matplotlib (jaxseq and the tests never do): runtime and test requirements leave it
    out, requirements-experiments.txt (the runtime pins plus it) and pyproject's `experiments` extra hold it, and
    README and experiments/README.md say how to install it."""
    assert "matplotlib" in _imported_modules("experiments")
    assert "matplotlib" not in _imported_modules("jaxseq") | _imported_modules("tests")
    for name in ("requirements.txt", "requirements-test.txt", "requirements-newest.txt"):
        assert "matplotlib" not in _pins(name), name
    assert "-r requirements.txt" in _read("requirements-experiments.txt").splitlines()
    assert set(_pins("requirements-experiments.txt")) == {"matplotlib"}
    extra = tomllib.loads(_read("pyproject.toml"))["project"]["optional-dependencies"]["experiments"]
    assert [re.split(r"[<>=\[ ]", d)[0].lower() for d in extra] == ["matplotlib"]
    for doc in ("README.md", "experiments/README.md"):
        assert "pip install -r requirements-experiments.txt" in _read(doc), doc
