"""Sampling from a trained model: `python -m jaxseq.generate --run-dir DIR --prompt TEXT`."""

from __future__ import annotations

import sys

from jaxseq import cli
from jaxseq.config import ConfigError
from jaxseq.training.data import decode_tokens, encode_text
from jaxseq.training import rundir
from jaxseq.training.sampling import sample


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
