"""Corpora, tokenizers and batches.

Three sources, one shape (a 1-D token array per split):
- the embedded corpus: the Python standard library's own source, byte-level (every machine has it);
- text files or globs: byte-level, or a local `tokenizer.json`;
- token files (`PREFIX.train.bin` / `PREFIX.val.bin`, memory-mapped uint16/uint32, the nanoGPT /
  Megatron convention) written by `python -m jaxseq.data`, with `PREFIX.json` describing them.

Batches are a pure function of (seed, position): resuming at a position reproduces the same data,
and each process materialises only the rows of the global batch that live on its devices.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxseq.config import ConfigError

BYTE_VOCAB = 256
VAL_EVERY = 20  # one file in 20 goes to validation


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # 1-D tokens
    val: np.ndarray
    vocab_size: int
    name: str
    tokenizer: str | None = None  # path of tokenizer.json; None: bytes


def _split_files(paths: list[str]) -> tuple[list[str], list[str]]:
    """Deterministic split by a hash of the file name, so adding files does not reshuffle the rest."""
    train, val = [], []
    for p in paths:
        digest = int(hashlib.sha1(os.path.basename(p).encode()).hexdigest(), 16)
        (val if digest % VAL_EVERY == 0 else train).append(p)
    if not val:  # tiny inputs: keep at least one validation file
        val.append(train.pop())
    return train, val


def _bytes_of(paths: list[str]) -> np.ndarray:
    return np.frombuffer(b"\n".join(Path(p).read_bytes() for p in paths), dtype=np.uint8)


def stdlib_files() -> list[str]:
    """The running interpreter's standard-library modules (top level; no tests), sorted."""
    root = sysconfig.get_paths()["stdlib"]
    return sorted(glob.glob(os.path.join(root, "*.py")))


def embedded_corpus() -> Corpus:
    files = stdlib_files()
    if len(files) < 10:
        raise ConfigError(f"the standard library at {sysconfig.get_paths()['stdlib']} has too few .py files")
    train, val = _split_files(files)
    return Corpus(_bytes_of(train), _bytes_of(val), BYTE_VOCAB, "python-stdlib")


def expand(pattern: str) -> list[str]:
    if os.path.isdir(pattern):
        pattern = os.path.join(pattern, "**", "*")
    paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not paths:
        raise ConfigError(f"data={pattern!r} matches no files")
    return paths


def load_tokenizer(path: str):
    from tokenizers import Tokenizer

    if not os.path.isfile(path):
        raise ConfigError(f"tokenizer={path!r} does not exist")
    return Tokenizer.from_file(path)


def encode(paths: list[str], tokenizer_path: str | None) -> np.ndarray:
    if tokenizer_path is None:
        return _bytes_of(paths)
    tok = load_tokenizer(tokenizer_path)
    ids = [i for p in paths for i in tok.encode(Path(p).read_text(errors="replace")).ids]
    return np.asarray(ids, dtype=np.uint32)


def load_corpus(data: str | None, tokenizer: str | None = None) -> Corpus:
    """None: the embedded corpus; `PREFIX.json` (or PREFIX) of token files; else text files/globs."""
    if data is None:
        return embedded_corpus()
    meta_path = data if data.endswith(".json") else data + ".json"
    if os.path.isfile(meta_path) and os.path.isfile(meta_path[:-5] + ".train.bin"):
        return load_token_files(meta_path[:-5])
    paths = expand(data)
    train, val = _split_files(paths) if len(paths) > 1 else (paths, paths)
    corpus = Corpus(encode(train, tokenizer), encode(val, tokenizer),
                    BYTE_VOCAB if tokenizer is None else load_tokenizer(tokenizer).get_vocab_size(), data, tokenizer)
    if len(paths) == 1:  # one file: the last 5% of its tokens validate
        cut = int(len(corpus.train) * 0.95)
        corpus = Corpus(corpus.train[:cut], corpus.train[cut:], corpus.vocab_size, data, tokenizer)
    return _checked(corpus)


def _checked(corpus: Corpus) -> Corpus:
    if corpus.train.size == 0:
        raise ConfigError(f"data={corpus.name!r} is empty")
    return corpus


def load_token_files(prefix: str) -> Corpus:
    meta = json.loads(Path(prefix + ".json").read_text())
    dtype = np.dtype(meta["dtype"])
    train = np.memmap(prefix + ".train.bin", dtype=dtype, mode="r")
    val = np.memmap(prefix + ".val.bin", dtype=dtype, mode="r")
    tok = meta.get("tokenizer")
    tok = None if tok is None else str(Path(prefix).parent / tok)
    return _checked(Corpus(train, val, int(meta["vocab_size"]), prefix, tok))


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy of the token frequencies, nats per token: what a model that ignores context achieves."""
    counts = np.bincount(np.asarray(tokens[: 50_000_000], dtype=np.int64), minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


@dataclass(frozen=True)
class Batches:
    """Random windows of seq_len+1 tokens; batch `position` is the same on every process and run."""

    tokens: np.ndarray
    seq_len: int
    batch_size: int  # global
    seed: int

    def __post_init__(self):
        if len(self.tokens) <= self.seq_len + 1:
            raise ConfigError(f"the data has {len(self.tokens)} tokens, fewer than seq_len+1={self.seq_len + 1}")

    def rows(self, position: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        """The `rows` of global batch number `position`: inputs and next-token targets, int32."""
        rng = np.random.default_rng([self.seed, position])
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, self.batch_size)[rows]
        windows = np.stack([np.asarray(self.tokens[s: s + self.seq_len + 1], dtype=np.int32) for s in starts])
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


# ---------------------------------------------------------------------------------------------
# python -m jaxseq.data: text → token files


def train_bpe(paths: list[str], vocab_size: int, out: str) -> str:
    """A byte-level BPE trained locally on the text (Hugging Face `tokenizers`), saved as JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train(paths, trainer)
    tok.save(out)
    return out


def write_token_files(inputs: str, prefix: str, vocab_size: int | None, tokenizer: str | None) -> dict:
    paths = expand(inputs)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    tok_name = None
    if tokenizer is None and vocab_size is not None:
        tokenizer = train_bpe(paths, vocab_size, prefix + ".tokenizer.json")
    if tokenizer is not None:
        tok_name = os.path.basename(prefix + ".tokenizer.json")
        if os.path.abspath(tokenizer) != os.path.abspath(prefix + ".tokenizer.json"):
            Path(prefix + ".tokenizer.json").write_text(Path(tokenizer).read_text())
        vocab = load_tokenizer(tokenizer).get_vocab_size()
    else:
        vocab = BYTE_VOCAB
    dtype = np.uint16 if vocab <= 65536 else np.uint32
    train, val = _split_files(paths) if len(paths) > 1 else (paths, paths)
    splits = {"train": encode(train, tokenizer), "val": encode(val, tokenizer)}
    if len(paths) == 1:
        cut = int(len(splits["train"]) * 0.95)
        splits = {"train": splits["train"][:cut], "val": splits["train"][cut:]}
    for name, tokens in splits.items():
        tokens.astype(dtype).tofile(f"{prefix}.{name}.bin")
    meta = {"dtype": np.dtype(dtype).name, "vocab_size": vocab, "tokenizer": tok_name,
            "train_tokens": int(splits["train"].size), "val_tokens": int(splits["val"].size)}
    Path(prefix + ".json").write_text(json.dumps(meta, indent=2))
    return meta


def encode_text(text: str, tokenizer_path: str | None) -> list[int]:
    if tokenizer_path is None:
        return list(text.encode())
    return load_tokenizer(tokenizer_path).encode(text).ids


def decode_tokens(ids: list[int], tokenizer_path: str | None) -> str:
    if tokenizer_path is None:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
    return load_tokenizer(tokenizer_path).decode(ids)
