"""`python -m jaxseq.data --input TEXT --output PREFIX [--vocab-size N | --tokenizer tokenizer.json]`:
tokenize text files into memory-mapped token files for `--data` (`jaxseq.training.data`)."""

from __future__ import annotations

import sys

from jaxseq import cli
from jaxseq.config import ConfigError
from jaxseq.training.data import write_token_files


def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog="python -m jaxseq.data",
                                description="Tokenize text files into memory-mapped token files for --data. "
                                            "Each file is a document; an end-of-document token follows each.")
    parser.add_argument("--input", required=True, help="text file, directory or glob")
    parser.add_argument("--output", required=True, help="output prefix: writes PREFIX.{train,val}.bin and PREFIX.json")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--vocab-size", type=int, help="train a byte-level BPE of this size on the input "
                                                      "(<|endoftext|> its last id)")
    group.add_argument("--tokenizer", help="a local tokenizer.json (its end-of-text token ends each document; "
                                           "<|endoftext|> is added to the copy if it has none)")
    args = parser.parse_args(argv)
    return cli.run(lambda: _tokenize(args))


def _tokenize(args) -> int:
    if args.vocab_size is not None and args.vocab_size < 258:
        raise ConfigError(f"vocab_size={args.vocab_size} must be at least 258 "
                          "(256 bytes, the end-of-document token and a merge)")
    meta, note = write_token_files(args.input, args.output, args.vocab_size, args.tokenizer,
                                    progress=sys.stderr.isatty())
    if note:
        print(note)
    print(f"wrote {args.output}.train.bin ({meta['train_tokens']:,} tokens), {args.output}.val.bin "
          f"({meta['val_tokens']:,} tokens), vocab {meta['vocab_size']}, {meta['dtype']}, "
          f"end of document: id {meta['eod_token']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
