"""Weights whose gradient waits: a layer's backward split into B (input gradients, now) and W (weight
gradients, later), which zero-bubble pipelining schedules apart (Qi et al., 2024; `schedule.py`, zb-h1).

A weight matmul y = op(x, w) (`ops.matmul`, a column-parallel linear) whose weight arrives wrapped in
`Deferred` runs under a custom VJP whose backward computes only dx and hands out (x, dy) as the cotangent of
a zero *probe* input shaped like them. The pipeline's B differentiates a chunk with respect to its input,
its other parameters (biases, norm scales) and the probes: it gets dx, those small gradients and, per weight
matmul, (x, dy): the W stash. W later turns them into the weights' gradients (`weight_gradients`): the VJP
of the same op with respect to its weight, whose forward product XLA drops as dead. B and W together run the
unsplit backward's matmuls once each, and nothing replays the forward beyond what the remat policy does.

Which op a weight's W runs is found by tracing the chunk once with probe-less `Deferred` weights
(`Taps.discover`): each op records its function, the weights it takes and the shapes of its x and y. A kernel
that feeds several matmuls in a layer has a probe, a stash entry and a W op per use, and W sums their gradients
(one probe shared by the uses would sum their (x, dy) pairs, which is no weight gradient). The
functions close over static configuration only (a spec, the model config, the Sharder), so W can run them
again. Under sequence parallelism the column-parallel op is the whole all-gather + matmul: the stash keeps
the sequence-split input and W gathers it again, as Megatron-LM's weight-gradient GEMM does.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxseq import remat


class TapOp(NamedTuple):
    """One deferred weight op of a layer, as `Taps.discover` found it."""

    fn: Callable  # op(x, w) → y
    paths: tuple[str, ...]  # the weights it takes (their paths in the layer's parameters), in w's leaf order
    treedef: Any  # w's structure
    x: jax.ShapeDtypeStruct  # its input, per layer
    y: Any  # its output(s), per layer


class Taps:
    """The deferred ops of one pipeline chunk's layers, keyed by use (`use_key`: the path of each op's first weight,
    and which use of it in the layer). Filled at trace time by `discover`; read by the probes (`probes`) and by W
    (`weight_gradients`)."""

    def __init__(self):  # static data of `Deferred`: hashed and compared by identity (object's own)
        self.ops: dict[str, TapOp] = {}

    def discover(self, run_layers: Callable, weights: dict, x) -> None:
        """Trace run_layers(x, weights with `Deferred` kernels, no probes) under eval_shape: each deferred op
        records itself. Weight matmul kernels are the leaves named "kernel"."""
        jax.eval_shape(lambda x, w: run_layers(x, self.wrap(w, None)), x, weights)
        missing = set(kernel_paths(weights)) - {p for op in self.ops.values() for p in op.paths}
        if missing:  # not an assert: a kernel used outside ops.matmul / column_parallel would lose its gradient
            raise RuntimeError(f"zb-h1: the kernels {sorted(missing)} reach no deferred matmul")

    def wrap(self, weights: dict, probes: dict | None) -> dict:
        """weights with each kernel as a `Deferred`, holding the probes of the ops it is the first kernel of, one
        per use in a layer's order (none where it is no op's first)."""
        def uses(path: str) -> tuple:
            return tuple(probes[use_key(path, i)] for i in range(len(probes)) if use_key(path, i) in probes)

        return map_kernels(lambda path, w: Deferred(w, None if probes is None else uses(path), path, self), weights)

    def probes(self, layers: int) -> dict:
        """Zero probes, [layers, …] per op: (x, y) as the op's input and output."""
        zeros = lambda a: jnp.zeros((layers, *a.shape), a.dtype)
        return {key: (zeros(op.x), jax.tree.map(zeros, op.y)) for key, op in self.ops.items()}

    def stash_avals(self, layers: int) -> dict:
        """One W stash slot: what `probes` holds, [layers, …] per op."""
        stacked = lambda a: jax.ShapeDtypeStruct((layers, *a.shape), a.dtype)
        return {key: (stacked(op.x), jax.tree.map(stacked, op.y)) for key, op in self.ops.items()}

    def record(self, key: str, op: TapOp) -> None:
        self.ops[key] = op

    def weight_gradients(self, weights: dict, stash: dict) -> dict:
        """{kernel path: gradient [layers, …]} from one W stash slot ({op key: (x, dy) [layers, …]}) and the
        chunk's weights ([layers, …] per leaf): per layer, each op's VJP with respect to its weights, summed over
        the ops a kernel takes part in."""
        by_path = dict(_kernel_items(weights))

        def layer(_, inputs):
            w, slot = inputs
            grads = {}
            for key, op in self.ops.items():
                x, dy = slot[key]
                _, vjp = jax.vjp(lambda ws: op.fn(x, ws), jax.tree.unflatten(op.treedef, [w[p] for p in op.paths]))
                for path, g in zip(op.paths, jax.tree.leaves(vjp(dy)[0])):
                    grads[path] = grads[path] + g if path in grads else g
            return None, grads

        _, grads = jax.lax.scan(layer, None, (by_path, stash))
        return grads


@jax.tree_util.register_pytree_node_class
class Deferred:
    """A kernel whose gradient is deferred: its value, its ops' probes (one per use in the layer, of the ops it is
    the first kernel of; None: discovery), its path in the layer's parameters and the chunk's `Taps`. `uses` counts
    the ops that have taken it as their first kernel in this trace (each trace of a layer unflattens its own)."""

    def __init__(self, value, probe, path: str, taps: Taps):
        self.value, self.probe, self.path, self.taps = value, probe, path, taps
        self.uses = 0

    def tree_flatten(self):
        return (self.value, self.probe), (self.path, self.taps)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)


def is_deferred(a) -> bool:
    return isinstance(a, Deferred)


def has_deferred(w) -> bool:
    return any(is_deferred(a) for a in jax.tree.leaves(w, is_leaf=is_deferred))


def apply(op: Callable, x, w):
    """op(x, w) for a weight (or dict of weights) w; where they are `Deferred`, with their gradient deferred to W:
    the probe-less trace records the op (`Taps.discover`), a probed one runs `_deferred`."""
    leaves = jax.tree.leaves(w, is_leaf=is_deferred)
    if not any(is_deferred(a) for a in leaves):
        return op(x, w)
    if not all(is_deferred(a) for a in leaves):
        raise ValueError("a deferred op's weights are all deferred or none is")
    plain = jax.tree.map(lambda a: a.value, w, is_leaf=is_deferred)
    first = leaves[0]
    use, first.uses = first.uses, first.uses + 1
    if first.probe is None:
        y = op(x, plain)
        aval = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
        first.taps.record(use_key(first.path, use), TapOp(op, tuple(a.path for a in leaves), jax.tree.structure(plain),
                                                          aval(x), jax.tree.map(aval, y)))
        return y
    if use >= len(first.probe):  # not an assert: a use without a probe would lose its gradient
        raise RuntimeError(f"zb-h1: the kernel {first.path} feeds {use + 1} deferred matmuls in a layer where "
                           f"discovery found {len(first.probe)}")
    # The output carries the name the dot policies save (they cannot see a dot inside a custom VJP).
    return jax.tree.map(lambda y: checkpoint_name(y, remat.MATMUL), _deferred(op, x, plain, first.probe[use]))


def use_key(path: str, use: int) -> str:
    """The key of an op by its first kernel's path and which use of that kernel it is in a layer (from 0): the
    path alone for the first use, "path#2" for the second, and so on."""
    return path if use == 0 else f"{path}#{use + 1}"


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _deferred(op, x, w, probe):
    return op(x, w)


def _deferred_fwd(op, x, w, probe):
    return op(x, w), (x, w)


def _deferred_bwd(op, res, dy):
    """dx now; the weight's cotangent zero (B takes the chunk's VJP with respect to its input, other parameters
    and probes only: JAX drops it); the probe's (x, dy), for W."""
    x, w = res
    _, vjp_x = jax.vjp(lambda x: op(x, w), x)
    (dx,) = vjp_x(dy)
    return dx, jax.tree.map(jnp.zeros_like, w), (x, dy)


_deferred.defvjp(_deferred_fwd, _deferred_bwd)


# ---------------------------------------------------------------------------------------------
# The kernels of a layer's parameters


def _path(path) -> str:
    return jax.tree_util.keystr(path)


def _kernel_items(weights: dict) -> list[tuple[str, Any]]:
    return [(_path(p), a) for p, a in jax.tree_util.tree_leaves_with_path(weights) if is_kernel(_path(p))]


def kernel_paths(weights: dict) -> list[str]:
    """The paths of the weight-matmul kernels among a layer's parameters (the leaves named "kernel")."""
    return [p for p, _ in _kernel_items(weights)]


def is_kernel(path: str) -> bool:
    return path.endswith("['kernel']")


def map_kernels(fn: Callable, weights: dict) -> dict:
    """weights with each kernel replaced by fn(its path, it)."""
    return jax.tree_util.tree_map_with_path(lambda p, a: fn(_path(p), a) if is_kernel(_path(p)) else a, weights)


def map_leaves(fn: Callable, tree: dict, *rest) -> dict:
    """jax.tree.map with each leaf's path string first."""
    return jax.tree_util.tree_map_with_path(lambda p, *a: fn(_path(p), *a), tree, *rest)


def split_kernels(weights: dict) -> tuple[dict, dict]:
    """(the kernels, the other parameters): `weights` with the others, or the kernels, replaced by None."""
    kernels = map_leaves(lambda p, a: a if is_kernel(p) else None, weights)
    others = map_leaves(lambda p, a: None if is_kernel(p) else a, weights)
    return kernels, others


def merge_kernels(kernels: dict, others: dict) -> dict:
    """The inverse of `split_kernels`."""
    return jax.tree.map(lambda k, o: o if k is None else k, kernels, others, is_leaf=lambda a: a is None)
