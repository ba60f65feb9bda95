"""A train step compiled once on a mesh, run for a few steps from a given state, checkpointed and restored: the
harness of the resume tests (test_resume.py, test_distributed_optimizer.py). Tiny float32 models, batches of
rows counting up in steps of 7 (learnable in a few steps)."""

import functools

import jax
import numpy as np

from jaxseq.mesh import make_mesh
from jaxseq.training import checkpoint as C
from jaxseq.training import train_step as T
from jaxseq.parallel.layout import Layout


def counting_batch(cfg, rows: int, step: int) -> dict:
    """Rows counting up in steps of 7 from random starts (seeded by `step`): learnable in a few steps."""
    starts = np.random.default_rng(step).integers(0, cfg.vocab_size, (rows, 1))
    tokens = ((starts + 7 * np.arange(cfg.seq_len + 1)) % cfg.vocab_size).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


class CompiledStep:
    """A mesh, its state shardings and the compiled step (`selective` remat); batch i is counting_batch(i). The step
    is compiled when first used (`compiled`, `run`): a test that reads only the mesh's state (`init`) compiles
    nothing."""

    def __init__(self, cfg, parallel, optimizer, micro_batches: int, rows: int, key, saved_at: int):
        self.cfg, self.parallel, self.optimizer, self.micro_batches = cfg, parallel, optimizer, micro_batches
        self.rows, self.key, self.saved_at = rows, key, saved_at
        self.mesh = make_mesh(parallel, jax.devices()[: parallel.num_devices])
        self.layout = Layout(cfg, parallel, self.mesh)
        self.shardings = T.state_shardings(self.layout, optimizer)
        self.abstract = jax.eval_shape(lambda: T.init_state(jax.random.key(0), self.layout, optimizer))

    @functools.cached_property
    def compiled(self):
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                self.abstract, self.shardings)
        step = T.make_train_step(self.layout, "selective", self.optimizer, self.micro_batches)
        return step.lower(abstract, self.batch(0), self.key).compile()

    def batch(self, step: int) -> dict:
        return counting_batch(self.cfg, self.rows, step)

    def init(self):
        return T.init_state(jax.random.key(0), self.layout, self.optimizer)

    def run(self, state, first: int, last: int, save_to=None) -> list[float]:
        """Steps first+1 … last (batch i for step i+1); saves a checkpoint after step `saved_at`."""
        losses = []
        for i in range(first, last):
            state, metrics = self.compiled(state, self.batch(i), self.key)
            losses.append(float(metrics["loss"]))
            if save_to is not None and i + 1 == self.saved_at:
                mgr = C.manager(save_to, async_save=False)
                C.save(mgr, self.saved_at, state, {"data_position": self.saved_at}, force=True)
                mgr.close()
        return losses

    def restore(self, directory):
        """The checkpoint at `saved_at`, restored into this mesh's shards."""
        state, meta = C.restore(C.manager(directory, async_save=False), self.abstract, self.shardings, self.mesh)
        assert int(state.step) == meta["data_position"] == self.saved_at
        for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(self.shardings)):
            assert got.sharding.is_equivalent_to(want, got.ndim)
        return state
