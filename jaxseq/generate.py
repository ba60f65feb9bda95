"""Sampling from a trained model: `python -m jaxseq.generate --run-dir DIR --prompt TEXT`."""

from __future__ import annotations

import sys

from jaxseq import cli
from jaxseq.config import ConfigError, default_layer_loop, on_platform, replace
from jaxseq.mesh import available_devices, use_host_devices
from jaxseq.training import rundir
from jaxseq.training.data import decode_tokens
from jaxseq.training.sampling import prompt_ids, sample, sampling_mesh, sampling_parallel


def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog="python -m jaxseq.generate", description=__doc__)
    parser.add_argument("--run-dir", required=True, help="a run directory written by python -m jaxseq.train "
                                                         "(or RUN/checkpoints/N for one step)")
    parser.add_argument("--prompt", default="def ", help="text to continue (empty: the start of a document)")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=40, help="0: sample from the whole vocabulary")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mesh", help="the devices the model is split over, as train's --mesh (e.g. tensor=8; "
                                       "pipe × tensor devices split the heads while sampling); default: every device")
    parser.add_argument("--host-devices", type=int, help="simulated CPU devices when there is no accelerator")
    args = parser.parse_args(argv)
    return cli.run(lambda: _generate(args))


def _generate(args) -> int:
    if args.max_tokens < 1 or args.temperature < 0 or args.top_k < 0:
        raise ConfigError("--max-tokens must be ≥ 1, --temperature and --top-k ≥ 0")
    use_host_devices(args.host_devices)
    cfg = rundir.saved_model(args.run_dir)
    parallel, mesh = rundir.resolve_mesh(cfg, args.mesh, available_devices())
    mesh = sampling_mesh(cfg, mesh)
    run = rundir.restore(args.run_dir, sampling_parallel(cfg, parallel), mesh, dtype=cfg.dtype)
    platform = mesh.devices.flat[0].platform  # the platform's kernels and layer loop, not the run's
    model = on_platform(replace(run.model, layer_loop=default_layer_loop(platform, parallel)), platform)
    ids = sample(run.params, model, prompt_ids(args.prompt, run.tokenizer, model.vocab_size), args.max_tokens,
                 args.temperature, args.top_k, args.seed, mesh=mesh)
    print(f"# step {run.step}\n{args.prompt}{decode_tokens(ids, run.tokenizer)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
