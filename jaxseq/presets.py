"""The models a run names by `--preset`: the papers' GPT shapes, GPT-2/3, Llama 2/3 and the mixtures of experts,
each a `ModelConfig` with its published shape."""

from __future__ import annotations

from jaxseq.config import ConfigError, ModelConfig

PRESETS: dict[str, ModelConfig] = {
    # tiny: for tests; 5as/h = 5·8·64/64 = 40.
    "tiny": ModelConfig(vocab_size=256, seq_len=64, hidden=64, heads=8, layers=2),
    # The default run: bytes of Python source (256 byte ids + the end-of-document id, as the data gives),
    # small enough to learn in minutes on 2 CPU cores.
    "stdlib-bytes": ModelConfig(vocab_size=257, seq_len=128, hidden=128, heads=4, layers=4, dropout=0.0),
    "gpt2-124m": ModelConfig(vocab_size=50257, seq_len=1024, hidden=768, heads=12, layers=12),
    "gpt2-350m": ModelConfig(vocab_size=50257, seq_len=1024, hidden=1024, heads=16, layers=24),
    # GPT-3 XL: 24 heads of width 128 (the GPT-3 paper's d_head), so attention is 3072 wide.
    "gpt3-1.3b": ModelConfig(vocab_size=50257, seq_len=2048, hidden=2048, heads=24, layers=24, kv_channels=128),
    # The paper's models (Korthikanti et al. 2022, Table 3): s = 2048, V = 51200.
    "megatron-22b": ModelConfig(vocab_size=51200, seq_len=2048, hidden=6144, heads=64, layers=48),
    "gpt3-175b": ModelConfig(vocab_size=51200, seq_len=2048, hidden=12288, heads=96, layers=96),
    "mt-nlg-530b": ModelConfig(vocab_size=51200, seq_len=2048, hidden=20480, heads=128, layers=105),
    "megatron-1t": ModelConfig(vocab_size=51200, seq_len=2048, hidden=25600, heads=160, layers=128),
    # Narayanan et al. 2021, Table 1 (weak scaling), the rows the presets above do not hold (its 529.6B and
    # 1008B rows are mt-nlg-530b and megatron-1t): experiments/autoconfig.py searches them.
    "megatron-1.7b": ModelConfig(vocab_size=51200, seq_len=2048, hidden=2304, heads=24, layers=24),
    "megatron-145.6b": ModelConfig(vocab_size=51200, seq_len=2048, hidden=12288, heads=96, layers=80),
    # The Llama family, with the published shapes (dropout 0 as trained). tiny-llama: for tests (8 query
    # heads sharing 2 K/V heads, an MLP width that is no multiple of hidden).
    "tiny-llama": ModelConfig(family="llama", vocab_size=256, seq_len=64, hidden=64, heads=8, kv_heads=2, layers=2,
                              ffn_hidden=176, dropout=0.0, ln_eps=1e-5),
    "llama2-7b": ModelConfig(family="llama", vocab_size=32000, seq_len=4096, hidden=4096, heads=32, layers=32,
                             ffn_hidden=11008, dropout=0.0, ln_eps=1e-5),
    "llama3-8b": ModelConfig(family="llama", vocab_size=128256, seq_len=8192, hidden=4096, heads=32, kv_heads=8,
                             layers=32, ffn_hidden=14336, dropout=0.0, ln_eps=1e-5, rope_theta=500000.0),
    "llama3-70b": ModelConfig(family="llama", vocab_size=128256, seq_len=8192, hidden=8192, heads=64, kv_heads=8,
                              layers=80, ffn_hidden=28672, dropout=0.0, ln_eps=1e-5, rope_theta=500000.0),
    # The mixture-of-experts family (Llama's attention, SwiGLU experts). tiny-moe: for tests (8 experts, top-2, an
    # expert width no multiple of hidden). Mixtral 8x7B and Qwen3-30B-A3B with their published shapes (Qwen3's
    # per-head q/k RMSNorm, head_dim 128 ≠ hidden/heads, renormalised top-8), their coefficients, trained at 4k tokens.
    "tiny-moe": ModelConfig(family="moe", vocab_size=256, seq_len=64, hidden=64, heads=8, kv_heads=2, layers=2,
                            ffn_hidden=48, dropout=0.0, moe_experts=8, moe_top_k=2),
    "mixtral-8x7b": ModelConfig(family="moe", vocab_size=32000, seq_len=4096, hidden=4096, heads=32, kv_heads=8,
                                layers=32, ffn_hidden=14336, dropout=0.0, rope_theta=1e6, moe_experts=8, moe_top_k=2,
                                moe_aux_loss_coef=0.02),
    "qwen3-30b-a3b": ModelConfig(family="moe", vocab_size=151936, seq_len=4096, hidden=2048, heads=32, kv_heads=4,
                                 kv_channels=128, layers=48, ffn_hidden=768, dropout=0.0, ln_eps=1e-6, rope_theta=1e6,
                                 qk_norm=True, moe_experts=128, moe_top_k=8, moe_norm_topk=True,
                                 moe_aux_loss_coef=0.001),
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)}")
    return PRESETS[name]
