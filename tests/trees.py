"""Gradient trees as the parallelism tests compare them, leaf by leaf against a reference at each leaf's own scale."""

import numpy as np


def comparable(grads):
    """GPT's Q, K and V leaves joined as GPT-2's one c_attn holds them ([L, h, 3, a, d], bias [L, 3, a, d]), the rest
    as it is. Why: the key bias's gradient is zero but for rounding (it adds q·b to every score of a row, which the
    softmax cancels), so a tolerance at its own scale compares noise; joined, it is held to the query's and value's
    scale, as before Q, K and V were three weights."""
    attn = grads.get("layers", {}).get("attn", {}) if isinstance(grads, dict) else {}
    if not {"q", "k", "v"} <= set(attn):
        return grads
    joined = {"kernel": np.stack([np.asarray(attn[n]["kernel"]) for n in "qkv"], axis=2),
              "bias": np.stack([np.asarray(attn[n]["bias"]) for n in "qkv"], axis=1)}
    rest = {name: leaf for name, leaf in attn.items() if name not in ("q", "k", "v")}
    return {**grads, "layers": {**grads["layers"], "attn": {**rest, "qkv": joined}}}
