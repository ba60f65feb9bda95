"""Sampling: top-k=1 is greedy decoding, equal to transformers' greedy `generate` of the same GPT-2
(a vocabulary that needs padding, a non-default LayerNorm epsilon); a seed fixes the sample."""

import jax
import numpy as np

try:
    import torch
    import transformers
except ImportError as e:  # the outside reference: fail, never skip
    raise ImportError(f"{e}; the comparisons with transformers need `pip install -r requirements-test.txt`") from e

from jaxseq import model as M
from jaxseq.config import preset, replace
from jaxseq.generate import decode_tokens, encode_text, sample
from jaxseq.mesh import Sharder

CFG = replace(preset("tiny"), seq_len=16, dtype="float32", dropout=0.0)


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


def test_greedy_generation_matches_transformers(tmp_path):
    """A random GPT-2 (vocabulary 300, padded to 384 in jaxseq; layer_norm_epsilon 1e-3) converted
    with from-hf: jaxseq's greedy continuation equals transformers' `generate(do_sample=False)`,
    token for token, including past the 128-entry padding boundary of the first shard."""
    from jaxseq import convert

    torch.manual_seed(1)
    config = transformers.GPT2Config(vocab_size=300, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                     layer_norm_epsilon=1e-3, bos_token_id=299, eos_token_id=299,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("wpe.weight"):
                p.mul_(20.0)  # positions that matter: a random model's greedy text then varies
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    cfg, params = convert.load(str(tmp_path / "run"))
    assert (cfg.vocab_size, cfg.ln_eps, params["embed"]["token"].shape[0]) == (300, 1e-3, 384)

    prompt = [5, 290, 17, 133, 2]
    ours = sample(params, cfg, prompt, 20, temperature=1.0, top_k=1)
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=299)
    assert ours == theirs[0, len(prompt):].tolist()
    assert len(set(ours)) > 3  # not a degenerate repetition of one token
