"""Every test runs on 8 simulated host devices (set before JAX initialises its backend)."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

# The same count as the option the training command sets: `jaxseq.train.main([... "--host-devices", "8"])`
# then runs in the pytest process (JAX refuses to change it once the backend has started).
jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, "tests expect 8 simulated host devices"
    return devs
