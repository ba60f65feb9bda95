"""GPU specs: the peak MFU divides by is the device kind's own, matched exactly (an H100 PCIe is not
counted at the SXM's 989 TFLOP/s because its name contains "H100"); the configurator's nodes read the
same peaks."""

from types import SimpleNamespace

import pytest

from jaxseq import hardware
from jaxseq.training.metrics import peak_tflops


@pytest.mark.parametrize("kind, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0),  # SXM
    ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H200", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA H100 NVL", None),  # contains "H100", is not listed: no peak rather than the SXM's
    ("NVIDIA GH200 480GB", None),  # contains "H200"
    ("H100", None),
])
def test_peak_is_matched_by_the_exact_device_kind(kind, peak):
    assert hardware.peak_tflops(kind) == peak
    assert peak_tflops(SimpleNamespace(platform="gpu", device_kind=kind)) == peak


def test_no_peak_off_gpu():
    assert peak_tflops(SimpleNamespace(platform="cpu", device_kind="NVIDIA H100 80GB HBM3")) is None


def test_the_nodes_read_the_gpu_table():
    assert hardware.HARDWARE["a100"].peak_tflops == hardware.GPUS["a100"].peak_tflops == 312.0
    assert hardware.HARDWARE["h100"].peak_tflops == hardware.GPUS["h100"].peak_tflops == 989.0
    kinds = [k for gpu in hardware.GPUS.values() for k in gpu.device_kinds]
    assert len(kinds) == len(set(kinds))  # each device kind has one peak
