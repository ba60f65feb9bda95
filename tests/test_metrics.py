"""The metrics log's TensorBoard writer (training/metrics.py) in a process that has not imported PyTorch."""

import subprocess
import sys

from commands import ROOT, env

PROBE = """
import sys
from jaxseq.training.metrics import MetricsLog
log = MetricsLog(sys.argv[1])
log.write({"step": 1, "loss": 2.5})
log.close()
print("torch imported by the writer:", "torch" in sys.modules)
import torch
print("torch importable after:", torch.__name__)
"""


def test_the_writer_leaves_pytorch_unimported_and_importable(tmp_path):
    """tensorboardX imports torch where it is installed (as in the test environment), only to accept torch tensors;
    the metrics log's writer does without it (about 2 s of every train command's start-up), and torch still imports
    after it."""
    done = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                          env=env(), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch imported by the writer: False" in done.stdout
    assert "torch importable after: torch" in done.stdout
    assert list((tmp_path / "tensorboard").iterdir()) and (tmp_path / "metrics.jsonl").read_text().count("\n") == 1
