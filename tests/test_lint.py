"""The static checks: ruff's pyflakes rules (undefined names, unused imports, redefinitions, …), syntax errors and
lines over 120 characters over the package, the tests and the experiments, as pyproject.toml's [tool.ruff] selects
them, with no finding. A name
left undefined by a move once crashed a documented command in a path no test reached."""

import subprocess
import sys

from commands import ROOT


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "jaxseq",
                           "tests", "experiments"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
