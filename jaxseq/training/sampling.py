"""Sampling from a model's parameters (the end-of-run sample; `python -m jaxseq.generate` is the command)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxseq.config import ModelConfig
from jaxseq.models import gpt as M
from jaxseq.sharding import Sharder


@partial(jax.jit, static_argnames=("cfg", "top_k"))
def _next_token(params, window, length, key, temperature, cfg: ModelConfig, top_k: int):
    """Sample the token after window[:length] (the rest of the window is ignored: attention is causal)."""
    x = M.hidden_states(params, window, cfg, Sharder(None), "none")
    logits = M.logits_fn(params, x, cfg, Sharder(None))[0, length - 1, : cfg.vocab_size]
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][-1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6))


def sample(params, cfg: ModelConfig, prompt: list[int], max_tokens: int, temperature: float = 0.8,
           top_k: int = 40, seed: int = 0) -> list[int]:
    """Autoregressive sampling in a sliding window of seq_len tokens (no KV cache: models here are small)."""
    tokens = list(prompt) or [ord("\n")]
    key = jax.random.key(seed)
    for i in range(max_tokens):
        context = tokens[-cfg.seq_len:]
        window = np.zeros((1, cfg.seq_len), np.int32)
        window[0, : len(context)] = context
        tok = _next_token(params, window, len(context), jax.random.fold_in(key, i), temperature, cfg,
                          min(top_k, cfg.vocab_size))
        tokens.append(int(tok))
    return tokens[len(prompt):]
