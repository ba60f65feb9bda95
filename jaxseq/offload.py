"""Host memory as a tier for what a layer stores: which of a remat policy's stored tensors may leave the device after
the forward and come back for the backward (`--offload NAMES`), the policy that sends them there, and the check of a
request at the edge.

A policy stores some tagged tensors (remat.py); offloading names some of them: those go to host memory (JAX's memory
kind `pinned_host`, `jax.ad_checkpoint.Offloadable`) when the forward makes them, and are copied back to the device
when the backward needs them; the rest of what the policy stores stays on the device, and what it recomputes is
recomputed. Nothing else changes: the numbers are the same (tests/test_offload.py).

On XLA:CPU JAX lowers the transfers to nothing (`jax._src.dispatch`: host placement is lowered for GPUs and TPUs
only): the CPU program computes the same numbers with the offloaded tensors kept where the others are. `train` says so
in its banner (`platform_note`).
"""

from __future__ import annotations

from typing import Callable, Iterable

import jax
from jax.ad_checkpoint import Offloadable

from jaxseq import remat
from jaxseq.remat import (CONTEXT, DECODER_LAYER_INPUT, KEY, LEAN, MLPWI, OUT_PROJ, QUERY, SELECTIVE, VALUE,
                          EVERYTHING, block_spec)

HOST = "pinned_host"  # the memory kind offloaded residuals live in: page-locked host memory, which DMA reaches
ALL = "all"  # every name the remat spec stores

# What each registered policy stores by name, so what offloading can move. The whitelist policies: their list.
# `full` keeps only the layer's input: tagged `decoder_layer_input` inside the layer, the value offloaded in its place
# (the checkpoint's own input is then needed by nothing). The dot policies keep matmul outputs by primitive, not by
# name: offloading a name moves the tagged tensor the backward reads in place of the dot output it came from; the
# ones whose dot output no other stored tensor still needs (q, k and v together: one QKV matmul) are listed.
STORED: dict[str, tuple[str, ...]] = {
    "none": EVERYTHING,
    "selective": SELECTIVE,
    "lean": LEAN,
    "full": (DECODER_LAYER_INPUT,),
    "dots": (DECODER_LAYER_INPUT, QUERY, KEY, VALUE, CONTEXT, OUT_PROJ, MLPWI),
    "dots_no_batch": (DECODER_LAYER_INPUT, QUERY, KEY, VALUE, OUT_PROJ, MLPWI),
}


def stored_names(spec: str) -> tuple[str, ...]:
    """The names a remat spec (a policy, or a block spec: both its policies) stores, in the order of the tags."""
    block = block_spec(spec)
    policies = (spec,) if block is None else (block[0], block[2])
    names = {n for p in policies for n in STORED[p]}
    return tuple(n for n in (*EVERYTHING, OUT_PROJ) if n in names)


def parse(text: str | None) -> tuple[str, ...]:
    """The names of an `--offload` value ("a,b", "all"; None or "": none), as given."""
    return tuple(n.strip() for n in (text or "").split(",") if n.strip())


def resolve(text: str | None, spec: str, tagged: Iterable[str]) -> tuple[str, ...]:
    """The checkpoint names to offload for `--offload text` under remat spec `spec`, where the model tags `tagged`
    (`models.model.tagged_names`): `all` is every name the spec stores that the model makes. A name the spec does not
    store, or that the model does not make (a dropout mask without dropout, the scores under fused attention): a
    ValueError of one line listing the valid names."""
    names, made = parse(text), set(tagged)
    valid = tuple(n for n in stored_names(spec) if n in made)
    if names == (ALL,):
        return valid
    known = set(EVERYTHING) | {OUT_PROJ, remat.MATMUL}
    for name in names:
        if name not in valid:
            why = "is no checkpoint name" if name not in known else f"is not a tensor remat={spec!r} stores here"
            raise ValueError(f"offload={name!r} {why}; valid: {ALL}, or any of {', '.join(valid) or '(none)'}")
    return tuple(n for n in valid if n in names)


def policy(base: Callable, names: tuple[str, ...]) -> Callable:
    """`base` (a jax.checkpoint policy) with the tensors tagged `names` offloaded to host memory instead: each is
    an `Offloadable` from the device to `HOST`; every other value is what `base` says (saved, or recomputed)."""
    if not names:
        return base
    tagged = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=names, offload_src="device", offload_dst=HOST)

    def placed(prim, *args, **params):
        where = tagged(prim, *args, **params)
        return where if isinstance(where, Offloadable) else base(prim, *args, **params)

    return placed


def for_policy(name: str, offload: tuple[str, ...]) -> tuple[str, ...]:
    """The names of `offload` that registered policy `name` stores (a block spec's segments each offload theirs)."""
    return tuple(n for n in offload if n in STORED[name])


def optimizer_note(platform: str) -> str:
    """The banner's line for `--offload-optimizer` on `platform`: where the state is and what crosses PCIe."""
    where = ("XLA:CPU: host memory is the devices' own, nothing moves" if platform == "cpu" else
             "each step copies them to the device for the update and back: 12 bytes a parameter each way, over "
             "the shards")
    return f"offload-optimizer: float32 master weights and Adam moments in host memory ({HOST}) between steps; {where}"


def platform_note(offload: tuple[str, ...], platform: str) -> str | None:
    """The banner's line about where the offloaded tensors go on `platform` (None when nothing is offloaded)."""
    if not offload:
        return None
    if platform == "cpu":
        return (f"offload: {', '.join(offload)} → host memory on GPUs; on XLA:CPU JAX lowers the transfers to nothing "
                "(the tensors stay where the rest are: same numbers, no memory saved)")
    return f"offload: {', '.join(offload)} → host memory ({HOST}) after the forward, back for the backward"
