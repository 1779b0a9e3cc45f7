"""`zerojax train | launch | export | config explain`: the command line over load_config and the trainer."""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from zerojax.config import Config, load_config
from zerojax.distributed import DistributedError
from zerojax.errors import ConfigError, LossScaleError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerojax", description="DeepSpeed's training engine on JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train the embedded GPT (or the model the config names)")
    train.add_argument("--config", required=True, help="JSON, hjson or YAML config file")
    train.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                       help="override config keys, e.g. --set zero_optimization.stage=2 run.steps=50")
    train.add_argument("--resume", nargs="?", const="latest", default=None, metavar="TAG",
                       help="continue the newest run under run.output_dir from its latest checkpoint "
                            "(or from TAG)")

    sub.add_parser("launch", add_help=False,
                   help="start N processes of a script joined through jax.distributed "
                        "(zerojax launch -n 2 train.py --config ...; see zerojax launch --help)")

    export = sub.add_parser("export", help="write a checkpoint's parameters to one safetensors file")
    export.add_argument("checkpoint_dir")
    export.add_argument("--out", required=True, help="output .safetensors file")
    export.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    export.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")

    config = sub.add_parser("config", help="inspect a config")
    config_sub = config.add_subparsers(dest="action", required=True)
    explain = config_sub.add_parser("explain", help="print every resolved value and where it came from")
    explain.add_argument("file")
    explain.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:  # its own parser: everything after the script belongs to the script
        from zerojax.launch import main as launch
        return launch(argv[1:])
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "export":
            return _export(args)
        return _explain(args)
    except (ConfigError, FileExistsError, FileNotFoundError) as e:
        print(f"zerojax: error: {e}", file=sys.stderr)
        return 2
    except LossScaleError as e:
        print(f"zerojax: error: {e}", file=sys.stderr)
        return 1
    except DistributedError as e:
        print(f"zerojax: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("zerojax: interrupted", file=sys.stderr)
        return 130


def _start(config: Config) -> None:
    """This process's devices (and its place in a multi-process run), before JAX starts."""
    from zerojax.distributed import start
    start(config)


def _train(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.set)
    _start(config)
    from zerojax.trainer import train
    train(config, resume=args.resume)
    return 0


def _export(args: argparse.Namespace) -> int:
    from zerojax.checkpoint import export_safetensors
    path = export_safetensors(args.checkpoint_dir, args.tag, args.out, dtype=args.dtype)
    print(f"wrote {path}")
    return 0


def _explain(args: argparse.Namespace) -> int:
    config = load_config(args.file, args.set)
    from zerojax.mesh import request_cpu_devices
    request_cpu_devices(config.mesh.cpu_devices)
    import jax
    dp = config.mesh.data or jax.device_count() // config.mesh.stage
    print(config.explain(dp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
