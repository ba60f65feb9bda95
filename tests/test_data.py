"""Data sources, the deterministic batch stream, and the tokenizer command's round trip."""

import numpy as np
import pytest

from commands import command, python_m
from jaxseq import data as data_command
from jaxseq.config import ConfigError
from jaxseq.training.data import Batches, embedded_corpus, load_corpus, load_tokenizer, unigram_entropy

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n"


def test_embedded_corpus_is_a_fixed_split_of_stdlib_bytes():
    a, b = embedded_corpus(), embedded_corpus()
    assert a.vocab_size == 256 and a.train.dtype == np.uint8
    assert len(a.train) > 1_000_000 and len(a.val) > 50_000
    assert np.array_equal(a.val, b.val)
    assert 2.5 < unigram_entropy(a.train, 256) < 3.6  # nats per byte


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
    assert corpus.vocab_size == 256 and len(corpus.val) > 0
    assert len(corpus.train) + len(corpus.val) == sum(len(TEXT) * (i + 1) for i in range(30)) + 28  # joined by \n


def test_tokenizer_command_round_trips(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"m{i}.py").write_text(TEXT.replace("Point", f"Point{i}") * 20)
    prefix = str(tmp_path / "tok" / "code")
    out = python_m("jaxseq.data", "--input", str(src), "--output", prefix, "--vocab-size", "300", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "wrote" in out.stdout and "uint16" in out.stdout
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
