"""Data sources, the deterministic batch stream, and the tokenizer command: its files equal a reference
encoding, with an end-of-document token after every document, for every kind of tokenizer."""

from pathlib import Path

import numpy as np
import pytest

from commands import command, python_m
from jaxseq import data as data_command
from jaxseq.config import ConfigError
from jaxseq.training import data as D
from jaxseq.training.data import Batches, embedded_corpus, load_corpus, load_tokenizer, unigram_entropy

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n"


def test_embedded_corpus_is_a_fixed_split_of_stdlib_bytes():
    a, b = embedded_corpus(), embedded_corpus()
    assert a.vocab_size == 257 and a.train.dtype == np.uint16  # 256 bytes and the end-of-document id
    assert len(a.train) > 1_000_000 and len(a.val) > 50_000
    assert np.array_equal(a.val, b.val)
    assert 2.5 < unigram_entropy(a.train, 257) < 3.6  # nats per byte
    # Every file is followed by the separator, and only files are.
    train, val = D._split_files(D.stdlib_files())
    assert int((a.train == D.BYTE_EOD).sum()) == len(train) and a.train[-1] == D.BYTE_EOD
    assert int((a.val == D.BYTE_EOD).sum()) == len(val)


def test_batches_are_a_pure_function_of_seed_and_position():
    tokens = np.arange(1000, dtype=np.uint16)
    batches = Batches(tokens, seq_len=16, batch_size=8, seed=3)
    first = batches.rows(5)
    again = Batches(tokens, 16, 8, 3).rows(5)
    assert np.array_equal(first["inputs"], again["inputs"])
    assert np.array_equal(first["targets"][:, :-1], first["inputs"][:, 1:])
    assert not np.array_equal(first["inputs"], batches.rows(6)["inputs"])
    # A process reads only its rows, and they are exactly its share of the global batch.
    assert np.array_equal(batches.rows(5, slice(4, 8))["inputs"], first["inputs"][4:8])
    assert first["inputs"].dtype == np.int32


def test_missing_empty_and_short_data_fail_clearly(tmp_path):
    with pytest.raises(ConfigError, match="matches no files"):
        load_corpus(str(tmp_path / "nothing*.txt"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        load_corpus(str(tmp_path / "empty.txt"))
    with pytest.raises(ConfigError, match="fewer than seq_len"):
        Batches(np.zeros(10, np.uint8), 16, 2, 0)


def test_text_files_split_by_name(tmp_path):
    for i in range(30):
        (tmp_path / f"f{i}.txt").write_text(TEXT * (i + 1))
    corpus = load_corpus(str(tmp_path / "*.txt"))
    assert corpus.vocab_size == 257 and len(corpus.val) > 0
    assert len(corpus.train) + len(corpus.val) == sum(len(TEXT) * (i + 1) for i in range(30)) + 30  # 30 separators
    assert int((corpus.train == 256).sum() + (corpus.val == 256).sum()) == 30


def _documents(directory) -> list[str]:
    """12 small files, one holding GPT-2's separator as text (it must stay text) and one past a piece."""
    directory.mkdir()
    for i in range(12):
        (directory / f"m{i}.py").write_text(TEXT.replace("Point", f"Point{i}") * (3 + i))
    (directory / "m3.py").write_text(TEXT + 'EOT = "<|endoftext|>"  # text, not a boundary\n')
    return sorted(str(p) for p in directory.iterdir())


def _tokenizer_file(path, documents, special_tokens) -> str:
    """A byte-level BPE trained on the documents with these special tokens (ids from 0), saved."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(documents, trainers.BpeTrainer(vocab_size=320, special_tokens=special_tokens, show_progress=False,
                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return str(path)


@pytest.mark.parametrize("kind", ["bytes", "trained BPE", "tokenizer with </s>", "tokenizer without one"])
def test_token_files_equal_a_reference_encoding_with_a_separator_after_each_document(tmp_path, monkeypatch, kind):
    """`python -m jaxseq.data`, read in pieces of 40 characters and tokenized 150 at a time, writes
    exactly each whole file's own encoding followed by the end-of-document id, in the split's order:
    bytes then 256; a trained BPE then <|endoftext|> (its last id); a tokenizer's own </s>; a
    tokenizer with no end-of-text token, <|endoftext|> added to the copy (and said so)."""
    monkeypatch.setattr(D, "PIECE_CHARS", 40, raising=False)  # (raising=False: the old code had neither)
    monkeypatch.setattr(D, "BATCH_CHARS", 150, raising=False)
    documents = _documents(tmp_path / "src")
    prefix = str(tmp_path / "out" / "code")
    flags = {"bytes": [], "trained BPE": ["--vocab-size", "300"],
             "tokenizer with </s>": ["--tokenizer", _tokenizer_file(tmp_path / "s.json", documents, ["<s>", "</s>"])],
             "tokenizer without one": ["--tokenizer", _tokenizer_file(tmp_path / "n.json", documents, [])]}[kind]
    out = command(data_command.main, "--input", str(tmp_path / "src"), "--output", prefix, *flags)
    corpus = load_corpus(prefix)
    train_files, val_files = D._split_files(documents)
    if kind == "bytes":
        eod = 256
        reference = {name: np.concatenate([np.append(np.frombuffer(Path(f).read_bytes(), np.uint8), eod)
                                           for f in files]) for name, files in (("train", train_files),
                                                                                ("val", val_files))}
        assert corpus.vocab_size == 257 and corpus.tokenizer is None
    else:
        tok = load_tokenizer(corpus.tokenizer)
        eod = {"trained BPE": corpus.vocab_size - 1, "tokenizer with </s>": 1,
               "tokenizer without one": corpus.vocab_size - 1}[kind]
        assert tok.id_to_token(eod) == {"tokenizer with </s>": "</s>"}.get(kind, "<|endoftext|>")
        assert ("added <|endoftext|> as id" in out.stdout) == (kind == "tokenizer without one")
        tok.encode_special_tokens = True  # a document's text is text
        reference = {name: np.concatenate([tok.encode(Path(f).read_text(), add_special_tokens=False).ids + [eod]
                                           for f in files]) for name, files in (("train", train_files),
                                                                                ("val", val_files))}
    assert f"end of document: id {eod}" in out.stdout
    for name, tokens in (("train", corpus.train), ("val", corpus.val)):
        np.testing.assert_array_equal(np.asarray(tokens), reference[name], err_msg=name)
    assert int((corpus.train == eod).sum()) == len(train_files) and int((corpus.val == eod).sum()) == len(val_files)


class _Counting:
    """A tokenizer that counts the characters it is asked to encode."""

    def __init__(self, tok, chars: list):
        object.__setattr__(self, "_tok", tok)
        object.__setattr__(self, "_chars", chars)

    def encode(self, text, *args, **kwargs):
        self._chars.append(len(text))
        return self._tok.encode(text, *args, **kwargs)

    def _batch(self, name):
        def encode(texts, *args, **kwargs):
            self._chars.extend(len(t) for t in texts)
            return getattr(self._tok, name)(texts, *args, **kwargs)
        return encode

    def __getattr__(self, name):
        return self._batch(name) if name.startswith("encode_batch") else getattr(self._tok, name)

    def __setattr__(self, name, value):
        setattr(self._tok, name, value)


def test_a_single_file_is_encoded_once(tmp_path, monkeypatch):
    """One file: its text goes through the tokenizer once (it went through twice, once per split),
    the last 5% of its tokens validate, and its end-of-document token closes the val split."""
    documents = _documents(tmp_path / "src")
    text = "".join(Path(f).read_text() for f in documents) * 20
    (tmp_path / "one.txt").write_text(text)
    tokenizer = _tokenizer_file(tmp_path / "tok.json", documents, ["</s>"])
    chars = []
    real_load = D.load_tokenizer
    monkeypatch.setattr(D, "load_tokenizer", lambda path: _Counting(real_load(path), chars))
    corpus = load_corpus(str(tmp_path / "one.txt"), tokenizer)  # the training command's path
    assert sum(chars) == len(text)
    total = len(corpus.train) + len(corpus.val)
    assert len(corpus.train) == int(total * 0.95) and corpus.val[-1] == 0 and (corpus.train == 0).sum() == 0
    chars.clear()
    command(data_command.main, "--input", str(tmp_path / "one.txt"), "--output", str(tmp_path / "one"),
            "--tokenizer", tokenizer)  # the data command's path
    assert sum(chars) == len(text)
    written = load_corpus(str(tmp_path / "one"))
    np.testing.assert_array_equal(np.concatenate([written.train, written.val]),
                                  np.concatenate([corpus.train, corpus.val]))
    assert len(written.train) == len(corpus.train)


def test_tokenizer_command_round_trips(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"m{i}.py").write_text(TEXT.replace("Point", f"Point{i}") * 20)
    prefix = str(tmp_path / "tok" / "code")
    out = python_m("jaxseq.data", "--input", str(src), "--output", prefix, "--vocab-size", "300", timeout=120)
    assert out.returncode == 0, out.stderr
    # no bar off a terminal; one line: the merges ran out before 300 ids (test_bpe_says_when_merges_run_out)
    assert "wrote" in out.stdout and "uint16" in out.stdout and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("the BPE has ") and "not the 300 asked for" in out.stderr
    corpus = load_corpus(prefix)
    assert isinstance(corpus.train, np.memmap) and corpus.train.dtype == np.uint16
    assert 256 < corpus.vocab_size <= 300 and int(corpus.train.max()) < corpus.vocab_size  # merges run out early
    tok = load_tokenizer(corpus.tokenizer)
    files = sorted(src.iterdir())
    joined = tok.decode(corpus.train.tolist() + corpus.val.tolist())
    assert joined.count("def add(a, b):") == 12 * 20
    assert len(corpus.train) < sum(len(f.read_text()) for f in files)  # BPE compresses
    # A bad value is one clear line.
    bad = command(data_command.main, "--input", str(tmp_path / "none*"), "--output", prefix, check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "matches no files" in bad.stderr
    small = command(data_command.main, "--input", str(src), "--output", prefix, "--vocab-size", "257", check=False)
    assert small.returncode == 2 and "vocab_size=257 must be at least 258" in small.stderr


def test_bpe_says_when_merges_run_out(tmp_path, caplog):
    """Asked for more ids than the text has pairs to merge, train_bpe returns fewer and says so in one warning
    line (asked for what it has, nothing)."""
    (tmp_path / "a.py").write_text(TEXT * 5)
    with caplog.at_level("WARNING", logger="jaxseq"):
        tok = D.train_bpe([str(tmp_path / "a.py")], 8192)
    got = tok.get_vocab_size()
    assert 257 < got < 8192
    assert [r.getMessage() for r in caplog.records] == [
        f"the BPE has {got} ids, not the 8192 asked for: the text ran out of pairs to merge after {got - 257} merges "
        "(more text, or a smaller --vocab-size)"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="jaxseq"):
        assert D.train_bpe([str(tmp_path / "a.py")], got).get_vocab_size() == got
    assert not caplog.records
