"""Sampling: top-k=1 is greedy decoding of the model's own logits; a seed fixes the sample. (Greedy
decoding against transformers' `generate` is in test_convert.py, beside the other comparisons.)"""

import jax
import numpy as np

from jaxseq.config import preset, replace
from jaxseq.models import gpt as M
from jaxseq.sharding import Sharder
from jaxseq.training.data import decode_tokens, encode_text
from jaxseq.training.sampling import sample

# A vocabulary that needs padding (300 → 384 rows) and a non-default LayerNorm epsilon.
CFG = replace(preset("tiny"), seq_len=16, vocab_size=300, ln_eps=1e-3, dtype="float32", dropout=0.0)


def _params():
    return M.init_params(jax.random.key(0), CFG, 1)


def test_top_k_one_is_greedy():
    params = _params()
    prompt = encode_text("def f", None)
    ids = sample(params, CFG, prompt, 4, temperature=1.0, top_k=1)
    tokens = list(prompt)
    for _ in range(4):
        window = np.asarray([tokens[-CFG.seq_len:]], np.int32)
        logits = M.logits_fn(params, M.hidden_states(params, window, CFG, Sharder(None), "none"), CFG, Sharder(None))
        tokens.append(int(np.argmax(np.asarray(logits)[0, -1, : CFG.vocab_size])))
    assert ids == tokens[len(prompt):]


def test_seeded_sampling_and_sliding_window():
    params = _params()
    a = sample(params, CFG, [1, 2, 3], 20, temperature=1.0, top_k=0, seed=7)  # runs past seq_len=16
    assert a == sample(params, CFG, [1, 2, 3], 20, temperature=1.0, top_k=0, seed=7)
    assert len(a) == 20 and all(0 <= t < CFG.vocab_size for t in a)


def test_bytes_round_trip():
    text = "héllo\n\tworld"
    assert decode_tokens(encode_text(text, None), None) == text

