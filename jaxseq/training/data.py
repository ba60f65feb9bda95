"""Corpora, tokenizers and batches.

Three sources, one shape (a 1-D token array per split):
- the embedded corpus: the Python standard library's own source, byte-level (every machine has it);
- text files or globs: byte-level, or a local `tokenizer.json`;
- token files (`PREFIX.train.bin` / `PREFIX.val.bin`, memory-mapped uint16/uint32, the nanoGPT /
  Megatron convention) written by `python -m jaxseq.data`, with `PREFIX.json` describing them.

Each file is a document, and every document's tokens are followed by an end-of-document token
(Megatron's `--append-eod`, GPT-2's `<|endoftext|>`): a byte-level corpus has 257 ids, the 256 byte
values and BYTE_EOD = 256 (a newline is text, not a boundary). Text is read and tokenized as a stream,
in pieces and batches of bounded size, so memory does not grow with the corpus.

Batches are a pure function of (seed, position): resuming at a position reproduces the same data,
and each process materialises only the rows of the global batch that live on its devices.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import shutil
import sysconfig
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from tqdm import tqdm

from jaxseq.config import ConfigError

BYTE_VOCAB = 257  # the byte values 0-255 and BYTE_EOD
BYTE_EOD = 256  # ends each document of a byte-level corpus
# A tokenizer's end-of-text token, as GPT-2 (and Qwen), Llama 3, Llama 2 / Mistral / T5, and Gemma name it.
EOD_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
NEW_EOD = "<|endoftext|>"  # added to a trained BPE (last id, as GPT-2's 50256) or a tokenizer with none
VAL_EVERY = 20  # one file in 20 goes to validation
PIECE_CHARS = 1 << 20  # a document is read and tokenized in pieces of about this many characters
BATCH_CHARS = 1 << 22  # characters per `encode_batch_fast` call: what bounds the memory of tokenizing

log = logging.getLogger("jaxseq")


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # 1-D tokens
    val: np.ndarray
    vocab_size: int
    name: str
    tokenizer: str | None = None  # path of tokenizer.json; None: bytes
    eod: int | None = None  # the id that ends each document (packed documents: ModelConfig.document_mask); None: none


def _split_files(paths: list[str]) -> tuple[list[str], list[str]]:
    """Deterministic split by a hash of the file name, so adding files does not reshuffle the rest."""
    train, val = [], []
    for p in paths:
        digest = int(hashlib.sha1(os.path.basename(p).encode()).hexdigest(), 16)
        (val if digest % VAL_EVERY == 0 else train).append(p)
    if not val:  # tiny inputs: keep at least one validation file
        val.append(train.pop())
    return train, val


def stdlib_files() -> list[str]:
    """The running interpreter's standard-library modules (top level; no tests), sorted."""
    root = sysconfig.get_paths()["stdlib"]
    return sorted(glob.glob(os.path.join(root, "*.py")))


def embedded_corpus() -> Corpus:
    files = stdlib_files()
    if len(files) < 10:
        raise ConfigError(f"the standard library at {sysconfig.get_paths()['stdlib']} has too few .py files")
    train, val = _split_files(files)
    return Corpus(_in_memory(train, None, BYTE_EOD), _in_memory(val, None, BYTE_EOD), BYTE_VOCAB, "python-stdlib",
                  eod=BYTE_EOD)


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


def end_of_document(tok) -> int | None:
    """The id of the tokenizer's end-of-text token (the first special token of EOD_TOKENS it has), or None."""
    special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    return next((special[text] for text in EOD_TOKENS if text in special), None)


def _corpus_tokenizer(tok):
    """`tok` for documents: a special token's text inside a document is text, not a separator."""
    tok.encode_special_tokens = True
    return tok


def _cut_point(text: str) -> int:
    """Where a piece of `text` may end (0: nowhere): just before the last newline, else the last ASCII
    whitespace, that follows a non-space character. No pre-token of a byte-level BPE (GPT-2's split
    pattern) spans such a point, so pieces cut there tokenize exactly as the whole text does; other
    pre-tokenizers may differ next to a cut, one point in about PIECE_CHARS characters."""
    for pattern in (r"(?<=\S)\n", r"(?<=\S)[ \t\r\f\v]"):
        last = None
        for last in re.finditer(pattern, text):
            pass
        if last is not None:
            return last.start()
    return 0


def _text_pieces(path: str, advance: Callable[[int], None]) -> Iterator[str]:
    """A file's text (UTF-8, bad bytes replaced, universal newlines: as `Path.read_text`) in pieces of
    about PIECE_CHARS characters (`_cut_point`); advance(bytes read) as it goes."""
    with open(path, encoding="utf-8", errors="replace") as f:
        carry, done = "", 0
        while block := f.read(PIECE_CHARS):
            text = carry + block
            cut = _cut_point(text)
            if cut:  # else no cut point yet: read on
                yield text[:cut]
            carry = text[cut:]
            advance(f.buffer.tell() - done)
            done = f.buffer.tell()
        if carry:
            yield carry


def _byte_pieces(path: str, advance: Callable[[int], None]) -> Iterator[np.ndarray]:
    with open(path, "rb") as f:
        while block := f.read(PIECE_CHARS):
            advance(len(block))
            yield np.frombuffer(block, np.uint8)


def document_tokens(paths: list[str], tok, eod: int | None,
                    advance: Callable[[int], None] = lambda n: None) -> Iterator[np.ndarray]:
    """The tokens of each file in order, each file followed by `eod` (None: nothing), as a stream of
    arrays of a few MiB: its bytes (uint8; BYTE_EOD in uint16) when `tok` is None, else its tokens
    (uint32), encoded `BATCH_CHARS` at a time with `encode_batch_fast` (no post-processor: no BOS)."""
    if tok is None:
        for path in paths:
            yield from _byte_pieces(path, advance)
            if eod is not None:
                yield np.array([eod], np.uint16)
        return
    batch, size = [], 0  # pieces of text, and the ints where a document ends
    for path in paths:
        for piece in _text_pieces(path, advance):
            batch.append(piece)
            size += len(piece)
            if size >= BATCH_CHARS:
                yield _encoded(tok, batch)
                batch, size = [], 0
        if eod is not None:
            batch.append(eod)
    if batch:
        yield _encoded(tok, batch)


def _encoded(tok, batch: list) -> np.ndarray:
    encodings = iter(tok.encode_batch_fast([x for x in batch if isinstance(x, str)], add_special_tokens=False))
    return np.concatenate([np.asarray(next(encodings).ids if isinstance(x, str) else [x], np.uint32) for x in batch])


def _in_memory(paths: list[str], tok, eod: int | None) -> np.ndarray:
    """`document_tokens` as one array: uint16 bytes, or uint32 tokens."""
    parts = list(document_tokens(paths, tok, eod))
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16 if tok is None else np.uint32)


def load_corpus(data: str | None, tokenizer: str | None = None) -> Corpus:
    """None: the embedded corpus; `PREFIX.json` (or PREFIX) of token files; else text files/globs."""
    if data is None:
        return embedded_corpus()
    meta_path = data if data.endswith(".json") else data + ".json"
    if os.path.isfile(meta_path) and os.path.isfile(meta_path[:-5] + ".train.bin"):
        return load_token_files(meta_path[:-5])
    paths = expand(data)
    tok = None if tokenizer is None else _corpus_tokenizer(load_tokenizer(tokenizer))
    eod = BYTE_EOD if tok is None else end_of_document(tok)
    if tok is not None and eod is None:
        log.warning("tokenizer %s has none of %s: documents are joined without a separator (python -m "
                    "jaxseq.data adds %s to a copy)", tokenizer, ", ".join(EOD_TOKENS), NEW_EOD)
    vocab = BYTE_VOCAB if tok is None else tok.get_vocab_size()
    if len(paths) == 1:  # one file, encoded once: the last 5% of its tokens validate
        tokens = _in_memory(paths, tok, eod)
        cut = int(len(tokens) * 0.95)
        return _checked(Corpus(tokens[:cut], tokens[cut:], vocab, data, tokenizer, eod))
    train, val = _split_files(paths)
    return _checked(Corpus(_in_memory(train, tok, eod), _in_memory(val, tok, eod), vocab, data, tokenizer, eod))


def _checked(corpus: Corpus) -> Corpus:
    if corpus.train.size == 0:
        raise ConfigError(f"data={corpus.name!r} is empty")
    return corpus


def load_token_files(prefix: str) -> Corpus:
    meta = json.loads(Path(prefix + ".json").read_text())
    dtype = np.dtype(meta["dtype"])
    for split in ("train", "val"):  # np.memmap of an empty file is a traceback ("cannot mmap an empty file")
        path = f"{prefix}.{split}.bin"
        if not os.path.isfile(path) or os.path.getsize(path) < dtype.itemsize:
            raise ConfigError(f"data={prefix!r}: {path} " + ("is missing" if not os.path.isfile(path) else
                              "holds no tokens") + " (python -m jaxseq.data writes both splits of non-empty text)")
    train = np.memmap(prefix + ".train.bin", dtype=dtype, mode="r")
    val = np.memmap(prefix + ".val.bin", dtype=dtype, mode="r")
    tok = meta.get("tokenizer")
    tok = None if tok is None else str(Path(prefix).parent / tok)
    return _checked(Corpus(train, val, int(meta["vocab_size"]), prefix, tok, meta.get("eod_token")))


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
        if len(self.tokens) < self.seq_len + 1:
            raise ConfigError(f"the data has {len(self.tokens)} tokens, fewer than seq_len+1={self.seq_len + 1}")

    def starts(self, position: int) -> np.ndarray:
        """The first token of each window of global batch number `position`: int64, uniform over every window
        the data holds (0 … len − seq_len − 1, the last included), so a token file past 2³¹ tokens or 2³²
        bytes is indexed whole."""
        rng = np.random.default_rng([self.seed, position])
        return rng.integers(0, len(self.tokens) - self.seq_len, self.batch_size, dtype=np.int64)

    def rows(self, position: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        """The `rows` of global batch number `position`: inputs and next-token targets, int32."""
        windows = np.stack([np.asarray(self.tokens[s: s + self.seq_len + 1], dtype=np.int32)
                            for s in self.starts(position)[rows]])
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


# ---------------------------------------------------------------------------------------------
# python -m jaxseq.data: text → token files


def train_bpe(paths: list[str], vocab_size: int, progress: bool = False):
    """A byte-level BPE of `vocab_size` ids trained locally on the text (Hugging Face `tokenizers`):
    the 256 bytes, the merges, and NEW_EOD as the last id (as GPT-2's 50256; fewer merges if they run out, and
    then a warning line says how many ids it has)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=progress)
    tok.train(paths, trainer)
    tok.add_special_tokens([NEW_EOD])
    if tok.get_vocab_size() < vocab_size:
        log.warning("the BPE has %d ids, not the %d asked for: the text ran out of pairs to merge after %d merges "
                    "(more text, or a smaller --vocab-size)", tok.get_vocab_size(), vocab_size,
                    tok.get_vocab_size() - 257)
    return tok


def _output_tokenizer(paths: list[str], vocab_size: int | None, tokenizer: str | None, progress: bool):
    """The tokenizer the token files are written with (None: bytes) and a line when NEW_EOD was added to
    the one given (which has no end-of-text token), else None."""
    if tokenizer is None:
        return (None if vocab_size is None else train_bpe(paths, vocab_size, progress)), None
    tok = load_tokenizer(tokenizer)
    if end_of_document(tok) is not None:
        return tok, None
    tok.add_special_tokens([NEW_EOD])
    return tok, (f"{tokenizer} has none of {', '.join(EOD_TOKENS)}: added {NEW_EOD} as id "
                 f"{tok.token_to_id(NEW_EOD)} to end each document")


def write_token_files(inputs: str, prefix: str, vocab_size: int | None, tokenizer: str | None,
                      progress: bool = False) -> tuple[dict, str | None]:
    """Tokenize the files of `inputs` into PREFIX.{train,val}.bin (streamed: memory does not grow with
    the corpus), PREFIX.json and PREFIX.tokenizer.json. Returns the metadata and a line to show when
    the end-of-document token was added to the given tokenizer (else None). `progress`: bars on stderr
    (training the BPE, tokenizing)."""
    paths = expand(inputs)
    if not any(os.path.getsize(path) for path in paths):
        raise ConfigError(f"--input {inputs!r}: " + ("the file is empty" if len(paths) == 1 else
                          f"its {len(paths)} files are empty") + ": no text to tokenize")
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    tok, note = _output_tokenizer(paths, vocab_size, tokenizer, progress)
    if tok is not None:
        tok.save(prefix + ".tokenizer.json")
        tok = _corpus_tokenizer(tok)
    vocab = BYTE_VOCAB if tok is None else tok.get_vocab_size()
    eod = BYTE_EOD if tok is None else end_of_document(tok)
    dtype = np.dtype(np.uint16 if vocab <= 65536 else np.uint32)
    splits = _split_files(paths) if len(paths) > 1 else (paths, [])
    files = {name: f"{prefix}.{name}.bin" for name in ("train", "val")}
    counts = {}
    with tqdm(total=sum(os.path.getsize(p) for p in paths), unit="B", unit_scale=True, desc="tokenizing",
              disable=not progress) as bar:
        for (name, path), split in zip(files.items(), splits):
            counts[name] = _write_tokens(path + ".partial", document_tokens(split, tok, eod, bar.update), dtype)
    if len(paths) == 1:  # one file: the last 5% of its tokens validate
        counts = _move_tail(files["train"] + ".partial", files["val"] + ".partial", counts["train"], dtype)
    if not (counts["train"] and counts["val"]):  # training would stop on it: say so here, write nothing
        for path in files.values():
            os.remove(path + ".partial")
        raise ConfigError(f"--input {inputs!r} gives {counts['train']:,} training and {counts['val']:,} validation "
                          "tokens; training needs both (one file validates with its last 5%, several with one "
                          "file in 20): give more text")
    for path in files.values():
        os.replace(path + ".partial", path)
    meta = {"dtype": dtype.name, "vocab_size": vocab, "eod_token": eod,
            "tokenizer": None if tok is None else os.path.basename(prefix + ".tokenizer.json"),
            "train_tokens": counts["train"], "val_tokens": counts["val"]}
    Path(prefix + ".json").write_text(json.dumps(meta, indent=2))  # last: the files it describes are complete
    return meta, note


def _write_tokens(path: str, stream: Iterator[np.ndarray], dtype: np.dtype) -> int:
    count = 0
    with open(path, "wb") as f:
        for tokens in stream:
            tokens.astype(dtype, copy=False).tofile(f)
            count += tokens.size
    return count


def _move_tail(train: str, val: str, total: int, dtype: np.dtype) -> dict:
    """The last 5% of the tokens in `train` moved to `val`, block by block."""
    cut = int(total * 0.95)
    with open(train, "r+b") as src, open(val, "wb") as dst:
        src.seek(cut * dtype.itemsize)
        shutil.copyfileobj(src, dst, 1 << 24)
        src.truncate(cut * dtype.itemsize)
    return {"train": cut, "val": total - cut}


def encode_text(text: str, tokenizer_path: str | None) -> list[int]:
    if tokenizer_path is None:
        return list(text.encode())
    return load_tokenizer(tokenizer_path).encode(text).ids


def printable(text: str) -> str:
    """`text` for a terminal: control characters but newline and tab become U+FFFD. A sampled byte such as
    0x0e (shift-out) or 0x1b (escape) would otherwise switch the terminal's character set or act as a command."""
    return "".join("\ufffd" if unicodedata.category(c) == "Cc" and c not in "\n\t" else c for c in text)


def decode_tokens(ids: list[int], tokenizer_path: str | None) -> str:
    if tokenizer_path is None:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
    return load_tokenizer(tokenizer_path).decode(ids)
