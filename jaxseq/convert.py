"""`python -m jaxseq.convert from-hf HF_DIR OUT` / `to-hf RUN_DIR_OR_CKPT OUT`: Hugging Face GPT-2, Llama,
Mixtral and Qwen3-MoE weights in and out. The work is `jaxseq.training.conversion` (also the Python API:
`load_hf`, `load`, `logits`)."""

from __future__ import annotations

import sys

from jaxseq import cli
from jaxseq.config import ConfigError
from jaxseq.mesh import use_host_devices
from jaxseq.models import model
from jaxseq.training.conversion import from_hf, hf_format, to_hf


# ---------------------------------------------------------------------------------------------
# Command line


def main(argv=None) -> int:
    p = cli.ArgumentParser(prog="python -m jaxseq.convert",
                           description="Convert GPT-2, Llama, Mixtral and Qwen3-MoE checkpoints between Hugging "
                                       "Face and jaxseq (offline).")
    devices = cli.ArgumentParser(add_help=False)
    devices.add_argument("--mesh", help="the devices the weights are split over while converting, e.g. tensor=8 or "
                                        "pipe=2,data=2,tensor=2 (default: every device, tensor=the largest that "
                                        "divides the heads)")
    devices.add_argument("--host-devices", type=int, help="simulated CPU devices when there is no accelerator")
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("from-hf", parents=[devices],
                       help="HF GPT-2, Llama, Mixtral or Qwen3-MoE directory (config.json + safetensors) → "
                            "jaxseq checkpoint")
    a.add_argument("hf_dir")
    a.add_argument("out")
    b = sub.add_parser("to-hf", parents=[devices],
                       help="jaxseq run/converted directory (or RUN/checkpoints/N) → HF directory")
    b.add_argument("run_dir")
    b.add_argument("out")
    b.add_argument("--max-shard-gb", type=float, default=5.0,
                   help="larger models are written as model-0000i-of-0000n.safetensors files of at most this many "
                        "GB (10⁹ bytes) plus model.safetensors.index.json (default %(default)s, as save_pretrained)")
    args = p.parse_args(argv)
    return cli.run(lambda: _convert(args))


def _convert(args) -> int:
    use_host_devices(args.host_devices)
    if args.command == "from-hf":
        cfg = from_hf(args.hf_dir, args.out, args.mesh)
    else:
        if not args.max_shard_gb > 0:
            raise ConfigError(f"--max-shard-gb {args.max_shard_gb} must be > 0")
        cfg = to_hf(args.run_dir, args.out, args.mesh, int(args.max_shard_gb * 10**9))
    kv = f" ({cfg.num_kv_heads} K/V)" if cfg.num_kv_heads != cfg.heads else ""
    print(f"wrote {args.out}: {hf_format(cfg)} with {cfg.layers} layers, hidden {cfg.hidden}, "
          f"{cfg.heads} heads{kv}, vocab {cfg.vocab_size}, {cfg.seq_len} positions "
          f"({model.num_params(cfg) / 1e6:.2f}M parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
