"""`zerojax train | launch | export | import-hf | import-deepspeed | tokenize | plot | sample | config explain`: the command line over
load_config and the trainer."""
from __future__ import annotations

import argparse
import errno
import sys
from typing import Any, Sequence

from zerojax.config import Config, load_config
from zerojax.runtime.distributed import DistributedError
from zerojax.errors import ConfigError, LossScaleError, NonFiniteError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerojax", description="DeepSpeed's training engine on JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train the embedded GPT (or the model the config names)")
    train.add_argument("--config", required=True, action="append",
                       help="JSON, hjson or YAML config file (one; changes go in --set)")
    train.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                       help="override config keys, e.g. --set zero_optimization.stage=2 run.steps=50; "
                            "every --set applies, left to right (a later value of a key wins)")
    train.add_argument("--resume", nargs="?", const="latest", default=None, metavar="TAG",
                       help="continue the run under run.output_dir that holds a checkpoint, from its latest "
                            "checkpoint (or from TAG); a path (a run, checkpoint or tag folder) picks exactly; "
                            "auto: continue it if it has a checkpoint, else start it (one command to restart a job)")

    sub.add_parser("launch", add_help=False,
                   help="start N processes of a script joined through jax.distributed "
                        "(zerojax launch -n 2 train.py --config ...; see zerojax launch --help)")

    export = sub.add_parser("export", help="write a checkpoint's parameters to one safetensors file (or, with "
                                           "--format hf, a folder Hugging Face transformers loads)")
    export.add_argument("checkpoint_dir", metavar="RUN_DIR", help="a run folder (its run.output_dir) or a checkpoint "
                                                                  "folder")
    export.add_argument("-o", "--out", required=True, help="output .safetensors file (--format hf: output folder)")
    export.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    export.add_argument("--tag", default=None, help="checkpoint tag (default: latest; best: the lowest validation "
                                                    "loss of a run with run.eval_every)")
    export.add_argument("--force", action="store_true", help="replace --out if it already exists")
    export.add_argument("--format", default="safetensors", choices=("safetensors", "hf", "peft", "deepspeed"),
                        help="safetensors: zerojax's parameter names in one file; hf: config.json + "
                             "model.safetensors with transformers' names (llama and gpt models; a LoRA run's "
                             "adapters merged into their weights); peft: a LoRA run's adapters as "
                             "adapter_config.json + adapter_model.safetensors (peft.PeftModel loads them onto "
                             "the base, --hf-source naming it); deepspeed: "
                             "the fp32 state dict DeepSpeed's zero_to_fp32.py writes (pytorch_model.bin; "
                             "--out a file or folder)")
    export.add_argument("--max-shard-size", default=None, metavar="SIZE",
                        help="--format hf: largest weight file, as transformers' max_shard_size (default 5GB); a "
                             "larger model is written as shards with model.safetensors.index.json")
    export.add_argument("--hf-source", default=None, metavar="DIR",
                        help="--format hf: the transformers folder the run was imported from (default: the one its "
                             "checkpoint records); tensors the model does not train are copied from it. 'none': "
                             "write only the model's own tensors")

    import_hf = sub.add_parser("import-hf", help="check a local Hugging Face transformers checkpoint folder and "
                                                 "print the model keys that train from it")
    import_hf.add_argument("directory", help="folder with config.json and model.safetensors (or its index)")

    import_ds = sub.add_parser("import-deepspeed", help="turn a DeepSpeed ZeRO checkpoint (global_stepN/ or the folder "
                                                        "holding `latest`) into a zerojax checkpoint that --resume "
                                                        "continues on any mesh and stage")
    import_ds.add_argument("source", help="DeepSpeed's save_checkpoint folder, or one of its global_stepN folders")
    import_ds.add_argument("destination", help="the zerojax checkpoint folder to write (e.g. runs/x/checkpoints)")
    import_ds.add_argument("--config", required=True, action="append",
                           help="the run's config: the model (model.*), optimizer and scheduler it continues with")
    import_ds.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    import_ds.add_argument("--tag", default=None, help="tag to write (default: DeepSpeed's, e.g. global_step100)")
    import_ds.add_argument("--weights-only", action="store_true",
                           help="weights and counters only, a fresh optimizer state (a non-Adam DeepSpeed optimizer)")

    tok = sub.add_parser("tokenize", help="tokenize a JSONL or text corpus once into a flat token file "
                                          "(data.source: tokens), so runs do not re-tokenize it at every start")
    tok.add_argument("path", help="the corpus: JSONL (one {\"text\": ...} a line) or a text file")
    tok.add_argument("--tokenizer", required=True, help="tokenizer.json (Hugging Face tokenizers format)")
    tok.add_argument("--out", required=True, help="the token file to write, e.g. train.bin")
    tok.add_argument("--source", choices=("jsonl", "file"), default=None,
                     help="jsonl or file (default: jsonl for *.jsonl, else file)")
    tok.add_argument("--text-key", default="text", help="the JSONL field holding the text (default: text)")
    tok.add_argument("--eos-id", type=int, default=None, help="id appended after each document (default: the "
                                                              "tokenizer's end-of-text token)")
    tok.add_argument("--dtype", choices=("uint16", "uint32"), default=None,
                     help="id type (default: uint16 when the tokenizer's ids fit, else uint32)")
    tok.add_argument("--max-bytes", type=int, default=None, help="read at most this many bytes of text, as "
                                                                 "data.max_bytes (default: the whole corpus)")
    tok.add_argument("--force", action="store_true", help="replace --out if it exists")

    est = sub.add_parser("estimate", help="model-state memory per device and host for every ZeRO stage and offload "
                                          "choice, a recommended layout, and a step-time estimate (docs/estimate.md)")
    est.add_argument("--config", required=True, action="append", help="config file (its optimizer, precision, "
                                                                      "batch and model)")
    est.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    est.add_argument("--model", default=None, help="an embedded model by name (default: the config's model)")
    est.add_argument("--hf-config", default=None, metavar="PATH", help="a Hugging Face config.json (Llama family "
                                                                       "or GPT-2)")
    est.add_argument("--params", type=int, default=None, metavar="N", help="total parameters (with --largest-layer)")
    est.add_argument("--largest-layer", type=int, default=None, metavar="N",
                     help="parameters of the largest layer (DeepSpeed's largest_layer_params)")
    est.add_argument("--devices", type=int, default=None, help="data-parallel devices in all (default: the "
                                                                 "config's mesh.data, or the local device count "
                                                                 "over stage x tensor)")
    est.add_argument("--tensor", default=None, metavar="T[,T...]",
                     help="tensor-parallel sizes to show (default: the divisors of --devices-per-host)")
    est.add_argument("--devices-per-host", type=int, default=None, help="devices per host (default: --devices)")
    est.add_argument("--device", default=None, help="preset for memory and step time: "
                                                    "h100, a100 or tpu-v5p")
    est.add_argument("--device-memory", default=None, metavar="SIZE", help="memory per device, e.g. 80GiB or 80GB "
                                                                           "(default: the preset's)")
    est.add_argument("--host-memory", default=None, metavar="SIZE", help="memory per host the offloaded state may use")
    est.add_argument("--activations", default=None, metavar="SIZE", help="activation memory per device to add")
    est.add_argument("--peak-flops", type=float, default=None, help="override the preset's peak FLOP/s")
    est.add_argument("--hbm-bandwidth", type=float, default=None, help="override the preset's HBM bytes/s")
    est.add_argument("--link-bandwidth", type=float, default=None, help="override the preset's per-device bytes/s "
                                                                        "within a host")
    est.add_argument("--inter-host-bandwidth", type=float, default=None, help="override the preset's per-device "
                                                                              "bytes/s between hosts")
    est.add_argument("--no-zero-init", action="store_true", help="DeepSpeed's stage-3 estimate without zero_init")
    est.add_argument("--buffer-factor", type=float, default=1.5, help="DeepSpeed's additional_buffer_factor")
    est.add_argument("--no-step-time", action="store_true", help="skip the step-time estimate")
    est.add_argument("--compiled", action="store_true", help="the embedded GPT's step time from its compiled step "
                                                             "(compiles it for each stage) instead of the formulas")

    config = sub.add_parser("config", help="inspect a config")
    config_sub = config.add_subparsers(dest="action", required=True)
    explain = config_sub.add_parser("explain", help="print every resolved value and where it came from")
    explain.add_argument("file")
    explain.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    plot = sub.add_parser("plot", help="draw loss, lr, grad-norm and throughput of runs into one PNG")
    plot.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (each holds metrics.jsonl)")
    plot.add_argument("-o", "--out", default="zerojax-runs.png", help="PNG to write (default: zerojax-runs.png)")
    plot.add_argument("--title", default=None)

    sample = sub.add_parser("sample", help="print text generated by a run's latest checkpoint")
    sample.add_argument("run_dir", nargs="?", default=None, metavar="RUN_DIR",
                        help="the run folder (its run.output_dir), as export and plot take it")
    sample.add_argument("--run", default=None, metavar="RUN_DIR", help="the run folder (the same as RUN_DIR)")
    sample.add_argument("-o", "--out", default=None, help="write the text to this file (never replaced: it must "
                                                          "not exist) instead of printing it")
    sample.add_argument("--prompt", default=None, help='text to continue (default: "def " on the embedded corpus)')
    sample.add_argument("--tokens", type=int, default=200, help="tokens to generate (default 200)")
    sample.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default 0.8)")
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--tag", default=None, help="checkpoint tag (default: latest; best: the lowest validation "
                                                    "loss)")
    sample.add_argument("--tokenizer", default=None, metavar="TOKENIZER_JSON",
                        help="turn ids into text with this tokenizer.json (default: the run's data.tokenizer; "
                             "needed for a run on a token file)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:  # its own parser: everything after the script belongs to the script
        from zerojax.runtime.launch import main as launch
        return launch(argv[1:])
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "export":
            return _export(args)
        if args.command == "import-hf":
            return _import_hf(args)
        if args.command == "import-deepspeed":
            return _import_deepspeed(args)
        if args.command == "tokenize":
            return _tokenize(args)
        if args.command in ("plot", "sample"):
            return _plot(args) if args.command == "plot" else _sample(args)
        if args.command == "estimate":
            return _estimate(args)
        return _explain(args)
    except (ConfigError, FileExistsError, FileNotFoundError) as e:
        print(f"zerojax: error: {e}", file=sys.stderr)
        return 2
    except (LossScaleError, NonFiniteError) as e:
        print(f"zerojax: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if e.errno not in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            raise
        print(f"zerojax: error: {e.strerror if e.filename is None else e}", file=sys.stderr)  # a full disk
        return 1
    except DistributedError as e:
        print(f"zerojax: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGUSR1 after saving (preemption.Preempted)
        print(f"zerojax: interrupted{f' ({e})' if str(e) else ''}", file=sys.stderr)
        if args.command == "train" and hasattr(e, "resume"):
            print(f"zerojax: continue the run with: {_resume_command(args, e.resume)}" if e.resume else
                  "zerojax: no checkpoint was saved; the same command starts the run again", file=sys.stderr)
        return getattr(e, "exit_code", 130)


def _resume_command(args: argparse.Namespace, resume: str) -> str:
    """The command that continues an interrupted run: this one, with `--resume` (train.py, `zerojax train`
    or `python -m zerojax.cli train`, as it was started)."""
    import os
    import shlex
    import shutil
    python = shutil.which("python")
    python = "python" if python and os.path.realpath(python) == os.path.realpath(sys.executable) else sys.executable
    script = sys.argv[0] if sys.argv else ""
    if os.path.basename(script) == "train.py":
        prog = [python, script]
    elif os.path.basename(script) == "zerojax":
        prog = ["zerojax", "train"]
    else:
        prog = [python, "-m", "zerojax.cli", "train"]
    return shlex.join([*prog, "--config", args.config[0], *(["--set", *args.set] if args.set else []),
                       "--resume", resume])


def _start(config: Config) -> None:
    """This process's devices (and its place in a multi-process run), before JAX starts."""
    from zerojax.runtime.distributed import start
    start(config)


def _one_config(files: Sequence[str]) -> str:
    """`--config` names one file: a second one would otherwise replace the first without a word."""
    if len(files) > 1:
        raise ConfigError(f"--config given {len(files)} times ({', '.join(files)}); give one file and put "
                          f"changes in --set key=value (or in a copy of the file)")
    return files[0]


def _train(args: argparse.Namespace) -> int:
    config = load_config(_one_config(args.config), args.set)
    from zerojax.runtime.compile_cache import enable
    enable(config.run.compile_cache)  # before anything compiles: a second run with the same shapes starts warm
    _start(config)
    from zerojax.app.trainer import train
    train(config, resume=args.resume)
    return 0


def _export(args: argparse.Namespace) -> int:
    from zerojax.app.deepspeed import check_not_deepspeed
    from zerojax.app.run_dirs import checkpoint_folder
    check_not_deepspeed(args.checkpoint_dir)
    args.checkpoint_dir = str(checkpoint_folder(args.checkpoint_dir))
    if args.format == "peft":
        if args.max_shard_size or args.dtype != "fp32":
            raise ConfigError("export --format peft: the adapters are written whole in fp32; drop --max-shard-size "
                              "and --dtype")
        from zerojax.models.hf import export_adapter
        path = export_adapter(args.checkpoint_dir, args.tag, args.out, overwrite=args.force, base=args.hf_source)
        print(f"wrote {path} (adapter_config.json, adapter_model.safetensors)")
        return 0
    if args.format != "hf" and (args.max_shard_size or args.hf_source):
        raise ConfigError("export: --max-shard-size and --hf-source are options of --format hf; add --format hf "
                          "or drop them")
    if args.format == "deepspeed":
        if args.dtype != "fp32":
            raise ConfigError("export --format deepspeed: zero_to_fp32.py's state dict is fp32; drop --dtype")
        from zerojax.app.deepspeed import export_fp32_state_dict
        print(f"wrote {export_fp32_state_dict(args.checkpoint_dir, args.tag, args.out, overwrite=args.force)}")
        return 0
    if args.format == "hf":
        from zerojax.models.hf import DEFAULT_MAX_SHARD_SIZE, export_checkpoint
        args.max_shard_size = args.max_shard_size or DEFAULT_MAX_SHARD_SIZE
        path = export_checkpoint(args.checkpoint_dir, args.tag, args.out, dtype=args.dtype, overwrite=args.force,
                                 source=args.hf_source, max_shard_size=args.max_shard_size)
        weights = sorted(p.name for p in path.iterdir() if p.name.startswith("model") and p.suffix == ".safetensors")
        print(f"wrote {path} (config.json, {', '.join(weights) if len(weights) < 4 else f'{len(weights)} shards'})")
        return 0
    from zerojax.checkpoint import export_safetensors
    path = export_safetensors(args.checkpoint_dir, args.tag, args.out, dtype=args.dtype, overwrite=args.force)
    print(f"wrote {path}")
    return 0


def _import_hf(args: argparse.Namespace) -> int:
    from zerojax.models.hf import describe
    print(describe(args.directory))
    return 0


def _import_deepspeed(args: argparse.Namespace) -> int:
    config = load_config(_one_config(args.config), args.set)
    _start(config)
    if config.mesh.stage > 1:
        raise ConfigError("import-deepspeed: mesh.stage > 1 (a pipeline) is not imported; import with mesh.stage: 1 "
                          "(the checkpoint then resumes on any data-parallel mesh and ZeRO stage)")
    from zerojax.app.deepspeed import import_into
    from zerojax.app.trainer import build_model
    from zerojax.planner.mesh import make_mesh
    plan = build_model(config, make_mesh(config)).plan
    tag_dir = import_into(args.source, args.destination, plan, config, tag=args.tag, weights_only=args.weights_only)
    print(f"wrote {tag_dir}; continue the run with: python train.py --config {args.config[0]} --resume {tag_dir}")
    return 0


def _tokenize(args: argparse.Namespace) -> int:
    from pathlib import Path
    from zerojax.runtime.data import write_token_file
    if Path(args.out).exists() and not args.force:
        raise FileExistsError(f"tokenize: {args.out} exists and is never overwritten silently; pass --force "
                              f"or choose another --out")
    source = args.source or ("jsonl" if args.path.endswith(".jsonl") else "file")
    data = {"source": source, "path": args.path, "tokenizer": args.tokenizer, "text_key": args.text_key,
            "max_bytes": args.max_bytes or max(Path(args.path).stat().st_size if Path(args.path).is_file() else 1, 1)}
    if args.eos_id is not None:
        data["eos_id"] = args.eos_id
    # only the data section matters; the batch size is there because every config needs one
    written = write_token_file(load_config({"train_batch_size": 1, "data": data}).data, args.out, args.dtype)
    print(f"wrote {written.tokens:,} tokens of {written.documents:,} documents ({written.dtype}) to {written.path}; "
          f"train on it with: --set data.source=tokens data.path={written.path} data.dtype={written.dtype} "
          f"data.eos_id={written.eos_id}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from zerojax.tools.plot import plot_runs
    print(f"wrote {plot_runs(args.runs, args.out, args.title)}")
    return 0


def _sample(args: argparse.Namespace) -> int:
    from pathlib import Path
    from zerojax.app.sample import load_run, sample_text
    if args.run_dir and args.run and args.run_dir != args.run:
        raise ConfigError(f"sample: two run folders given ({args.run_dir} and --run {args.run}); give one")
    run = args.run_dir or args.run
    if run is None:
        raise ConfigError("sample: give the run folder: zerojax sample RUN_DIR (its run.output_dir)")
    if args.out and Path(args.out).exists():
        raise FileExistsError(f"sample: -o {args.out} exists and is never overwritten; choose another file")
    config, params, where = load_run(run, args.tag)
    print(f"# {where}", file=sys.stderr)
    text = sample_text(config, params, args.prompt, args.tokens, temperature=args.temperature, seed=args.seed,
                       tokenizer=args.tokenizer)
    if args.out:
        Path(args.out).write_text(text + "\n")
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


def _estimate(args: argparse.Namespace) -> int:
    config = load_config(_one_config(args.config), args.set)
    from zerojax.core.mesh import request_cpu_devices
    request_cpu_devices(config.mesh.cpu_devices)
    from zerojax.tools.estimate import build_request, choose_model, report
    model = choose_model(config, args.model, args.hf_config, args.params, args.largest_layer)
    print(report(config, model, build_request(config, args)))
    return 0


def _explain(args: argparse.Namespace) -> int:
    config = load_config(args.file, args.set)
    from zerojax.core.mesh import request_cpu_devices
    request_cpu_devices(config.mesh.cpu_devices)
    import jax
    dp = config.mesh.data_parallel(jax.device_count())
    print(config.explain(dp))
    from zerojax.planner.mesh import is_hierarchical
    m = config.mesh
    if m.tensor > 1 or m.expert > 1 or m.sequence > 1 or is_hierarchical(config):
        print(_axis_plans(config))  # which weights of the config's model each axis splits, and how
    return 0


def _axis_plans(config: Any) -> str:
    """The tensor, hierarchical data, expert and sequence plans of the model the config's `model` section names
    (train.py's); a config without one describes a model given in code, whose plans `initialize`
    prints at start-up."""
    from zerojax.app.reports import named_model
    if not named_model(config):
        return ("axis plans: the config names no model (a model given in code gets its tensor, expert and "
                "sequence plans at start-up, or from zerojax.plan(config, mesh, params))")
    from zerojax.app.trainer import build_model
    from zerojax.planner.axes import axis_plans
    from zerojax.planner.mesh import make_mesh
    try:
        plan = build_model(config, make_mesh(config)).plan
    except ConfigError as e:
        return f"axis plans: not shown ({e})"
    return "\n".join(t for t in (plan.tensor_plan, *axis_plans(plan, config.model)) if t is not None)


if __name__ == "__main__":
    sys.exit(main())
