"""Sampling from a trained model: `python -m jaxseq.generate --run-dir DIR --prompt TEXT`."""

from __future__ import annotations

import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxseq import cli
from jaxseq import model as M
from jaxseq import rundir
from jaxseq.config import ConfigError, ModelConfig
from jaxseq.mesh import Sharder


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


def encode_text(text: str, tokenizer_path: str | None) -> list[int]:
    if tokenizer_path is None:
        return list(text.encode())
    from jaxseq.data import load_tokenizer

    return load_tokenizer(tokenizer_path).encode(text).ids


def decode_tokens(ids: list[int], tokenizer_path: str | None) -> str:
    if tokenizer_path is None:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
    from jaxseq.data import load_tokenizer

    return load_tokenizer(tokenizer_path).decode(ids)


def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog="python -m jaxseq.generate", description=__doc__)
    parser.add_argument("--run-dir", required=True, help="a run directory written by python -m jaxseq.train")
    parser.add_argument("--prompt", default="def ", help="text to continue")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=40, help="0: sample from the whole vocabulary")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    return cli.run(lambda: _generate(args))


def _generate(args) -> int:
    if args.max_tokens < 1 or args.temperature < 0 or args.top_k < 0:
        raise ConfigError("--max-tokens must be ≥ 1, --temperature and --top-k ≥ 0")
    run = rundir.restore(args.run_dir)
    ids = sample(run.params, run.model, encode_text(args.prompt, run.tokenizer), args.max_tokens, args.temperature,
                 args.top_k, args.seed)
    print(f"# step {run.step}\n{args.prompt}{decode_tokens(ids, run.tokenizer)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
