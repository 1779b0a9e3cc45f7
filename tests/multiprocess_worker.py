"""One process of a multi-process test run, started by `zerojax launch` (see test_distributed.py).

    zerojax launch -n 2 tests/multiprocess_worker.py train OUT STAGE [STAGE ...]
    zerojax launch -n 2 tests/multiprocess_worker.py hang
    zerojax launch -n 2 tests/multiprocess_worker.py mismatch
    zerojax launch -n 2 --hang-timeout S tests/multiprocess_worker.py stall
    zerojax launch -n 2 tests/multiprocess_worker.py saveload OUT
    zerojax launch -n 2 tests/multiprocess_worker.py diverge KEY
    zerojax launch -n 2 tests/multiprocess_worker.py generate OUT
    zerojax launch -n 2 tests/multiprocess_worker.py stale KEY=VALUE TRAIN_PY_ARGS...
    zerojax launch -n 2 tests/multiprocess_worker.py wider

`train`: the tiny MLP of helpers.py, STEPS steps per ZeRO stage on an 8-device mesh split over the
processes, each process feeding only its own rows; then a checkpoint (every process writes its
shards) and, from process 0, the final parameters gathered into OUT/stage<S>.npz.
`hang`: join, say "ready", then run collectives until killed (the launcher test kills one process).
`mismatch`: process 1 has another learning rate; distributed.check_consistency must say so.
`saveload`: save (asynchronously, as the engine does by default), train on while it commits, then
load the latest tag, three times, on a slow shared file system (process 0's meta.json/`latest` writes take a second):
every process must load the tag just saved.
`diverge`: process 1 sets one key differently (KEY: threshold, a stage-3 persistence threshold that keeps
its layers whole; stage, ZeRO stage 3 against 2) with the consistency check off, as a run whose hosts
disagree would: the first train_batch must be refused on both processes, in seconds, not hang.
`generate`: a ZeRO-3 GPT engine generates, greedy and sampled, with an end token that ends every row
of process 0 within a few tokens while process 1's rows run to max_new_tokens; process 0 writes the
results to OUT/generate.npz (test_generate.py compares them with one process).
`stale`: train.py with TRAIN_PY_ARGS (ending in --set ...), process 1 with KEY=VALUE appended to its
--set, as a host with a stale config file would be: refused on both processes before anything compiles.
`wider`: the engine path with the same config everywhere but a wider model on process 1 (another code
version on one host): `zerojax.initialize` must refuse it on both processes before compiling anything.
`stall`: ZeRO-3 steps under the hang watchdog, process 1 deliberately stalls before step 4 (the
other then waits in that step's collectives); both must report and the launcher must name them.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402

if os.environ.get("ZEROJAX_TEST_CACHE"):
    jax.config.update("jax_compilation_cache_dir", os.environ["ZEROJAX_TEST_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

import numpy as np  # noqa: E402

import zerojax  # noqa: E402
from zerojax.runtime.distributed import local_rows, start  # noqa: E402

STEPS = 3


def config_for(stage: int, **extra: object) -> zerojax.Config:
    from helpers import make_config
    extra = {"mesh": {"cpu_devices": 8}, "distributed": {"check_consistency": True}, **extra}
    return make_config(stage, gas=2, **extra)


def batches(n: int) -> list[dict[str, np.ndarray]]:
    from helpers import make_batch
    return [make_batch(32, seed=i) for i in range(n)]


def train(out: Path, stages: list[int]) -> None:
    from helpers import layerwise_loss, mlp_params
    start(config_for(stages[0]))
    assert jax.process_count() > 1 and jax.device_count() == 8, (jax.process_count(), jax.device_count())
    for stage in stages:
        config = config_for(stage)
        engine = zerojax.initialize(config, params=mlp_params(0), loss_fn=layerwise_loss)
        mine = local_rows(engine.plan.batch_sharding, engine.train_batch_size())
        for batch in batches(STEPS):
            engine.train_batch({k: v[mine] for k, v in batch.items()})  # only this process's rows
        engine.save_checkpoint(str(out / f"ckpt{stage}"), async_save=False)
        from jax.experimental import multihost_utils
        whole = multihost_utils.process_allgather(engine.params, tiled=True)
        if jax.process_index() == 0:
            flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(whole)}
            np.savez(out / f"stage{stage}.npz", **flat)
        print(f"stage {stage}: {engine.global_steps} steps done", flush=True)


def hang() -> None:
    start(zerojax.load_config({"train_batch_size": 8, "mesh": {"cpu_devices": 4}}))
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    total = jax.jit(lambda x: jnp.sum(x), out_shardings=NamedSharding(mesh, P()))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), np.ones(2, np.float32), (4,))
    float(total(x))
    print(f"ready pid {os.getpid()}", flush=True)
    while True:
        float(total(x))  # a collective: with a peer gone, this blocks or fails
        time.sleep(0.1)


def mismatch() -> None:
    from helpers import mlp_params, mse_loss
    optimizer = {"type": "Adam", "params": {"lr": 1e-2 if int(os.environ["ZEROJAX_PROCESS_ID"]) == 0 else 2e-2}}
    config = config_for(1, optimizer=optimizer)
    start(config)
    zerojax.initialize(config, params=mlp_params(0), loss_fn=mse_loss)
    print("no mismatch found", flush=True)


def diverge(key: str) -> None:
    from helpers import layerwise_loss, make_batch, mlp_params
    other = int(os.environ["ZEROJAX_PROCESS_ID"]) == 1
    zero = {"threshold": {"stage3_param_persistence_threshold": 10**6 if other else 0},
            "stage": {"stage": 2 if other else 3}}[key]
    config = config_for(3, distributed={"check_consistency": False})
    config = zerojax.load_config({**config.to_dict(), "zero_optimization": {**config.to_dict()["zero_optimization"],
                                                                            **zero}})
    start(config)
    engine = zerojax.initialize(config, params=mlp_params(0), loss_fn=layerwise_loss)
    mine = local_rows(engine.plan.batch_sharding, engine.train_batch_size())
    started = time.perf_counter()
    try:
        engine.train_batch(jax.tree.map(lambda x: x[mine], make_batch(32, seed=0)))
    except Exception as e:
        print(f"refused after {time.perf_counter() - started:.1f} s: {type(e).__name__}: {e}", flush=True)
        raise SystemExit(3)
    print("no divergence found", flush=True)


def stale(override: str, args: list[str]) -> None:
    from zerojax.app.cli import main
    if int(os.environ["ZEROJAX_PROCESS_ID"]) == 1:
        args = [*args, override]
    started = time.perf_counter()
    code = main(["train", *args])
    print(f"train.py exited {code} after {time.perf_counter() - started:.1f} s", flush=True)
    raise SystemExit(code)


def wider() -> None:
    from helpers import layerwise_loss, mlp_params
    config = config_for(3, distributed={})  # the check as it is by default
    start(config)
    params = mlp_params(0)
    if jax.process_index() == 1:
        params = {**params, "w_out": np.zeros((params["w_out"].shape[0], 5), np.float32),
                  "b_out": np.zeros(5, np.float32)}
    started = time.perf_counter()
    try:
        zerojax.initialize(config, params=params, loss_fn=layerwise_loss)
    except Exception as e:
        print(f"refused after {time.perf_counter() - started:.1f} s: {type(e).__name__}: {e}", flush=True)
        raise SystemExit(3)
    print("no mismatch found", flush=True)


def stall() -> None:
    from helpers import layerwise_loss, make_batch, mlp_params
    from zerojax.runtime.watchdog import beat, watching
    config = config_for(3)
    start(config)
    engine = zerojax.initialize(config, params=mlp_params(0), loss_fn=layerwise_loss)
    mine = local_rows(engine.plan.batch_sharding, engine.train_batch_size())
    with watching(config.distributed.hang_timeout):  # the launcher's --hang-timeout wins
        for step in range(1, 1000):
            beat(f"in train step {step}", f"step {step - 1}", allowance=6.0 if step == 1 else 1.0)
            if step == 4 and jax.process_index() == 1:
                print("stalling before step 4", flush=True)
                time.sleep(600)  # a deliberately stalled process
            batch = make_batch(32, seed=step)
            engine.train_batch({k: v[mine] for k, v in batch.items()})


def saveload(out: Path) -> None:
    from helpers import layerwise_loss, make_batch, mlp_params
    from zerojax.checkpoint import saving
    config = config_for(3)
    start(config)
    if jax.process_index() == 0:  # process 0 alone writes meta.json and `latest`: make that slow
        write = saving.write_atomic
        saving.write_atomic = lambda path, text: (time.sleep(1.0), write(path, text))[1]
    engine = zerojax.initialize(config, params=mlp_params(0), loss_fn=layerwise_loss)
    mine = local_rows(engine.plan.batch_sharding, engine.train_batch_size())
    def step(seed: int) -> None:
        batch = make_batch(32, seed=seed)
        engine.train_batch({k: v[mine] for k, v in batch.items()})

    for round_ in range(1, 4):
        step(round_)
        tag = engine.save_checkpoint(str(out))  # asynchronous: it commits while the next steps run
        step(100 + round_)
        step(200 + round_)
        path, _ = engine.load_checkpoint(str(out))  # tag None: the latest
        print(f"round {round_}: saved {tag}, loaded {Path(path).name} at step {engine.global_steps}", flush=True)


def generate_engine(mesh: object = None) -> zerojax.Engine:
    """The tiny ZeRO-3 GPT both sides of the generate test build (8 devices, one row each)."""
    from zerojax.models import decode, gpt
    config = zerojax.load_config({
        "train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_allow_untested_optimizer": True, "mesh": {"cpu_devices": 8},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "model": dict(name="gpt", vocab_size=64, seq_len=32, d_model=32, n_heads=4, n_layers=2)})
    if mesh is None:
        start(config)
    return zerojax.initialize(config, params=gpt.init_params(config.model, 0), loss_fn=gpt.make_loss_fn(config.model),
                              mesh=mesh, decode=decode.decoder(config.model))


#: rows 0-3 (process 0's devices) share one prompt; rows 4-7 (process 1's) differ
GEN_PROMPTS = [[5, 9, 2]] * 4 + [[3, 3, 3, 3], [20], [33, 17, 50], [1, 2, 3, 4, 5, 6]]
GEN_TOKENS = 12


def generate_all(engine: zerojax.Engine) -> dict[str, np.ndarray]:
    """Greedy without an end token; then, with an end token that rows 0-3 emit and rows 4-7 never do,
    greedy and sampled: the rows of one process end early, the other's run to the last token."""
    free = engine.generate(GEN_PROMPTS, GEN_TOKENS)
    toks = np.asarray(free.tokens)
    eos = next(int(t) for t in toks[0, 1:] if t not in toks[4:])
    out = {"free": toks, "eos": np.int32(eos)}
    for name, kw in (("greedy", {}), ("sampled", {"temperature": 1.0, "seed": 7})):
        g = engine.generate(GEN_PROMPTS, GEN_TOKENS, eos_id=eos, **kw)
        out.update({f"{name}_tokens": np.asarray(g.tokens), f"{name}_logprobs": np.asarray(g.logprobs),
                    f"{name}_lengths": np.asarray(g.lengths)})
    return out


def generate(out: Path) -> None:
    engine = generate_engine()
    assert jax.process_count() > 1 and jax.device_count() == 8, (jax.process_count(), jax.device_count())
    got = generate_all(engine)
    lengths = got["greedy_lengths"]
    print(f"generate: process {jax.process_index()} rows end at {lengths.tolist()}", flush=True)
    if jax.process_index() == 0:
        np.savez(out / "generate.npz", **got)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "train":
        train(Path(sys.argv[2]), [int(s) for s in sys.argv[3:]])
    elif mode == "hang":
        hang()
    elif mode == "mismatch":
        mismatch()
    elif mode == "stall":
        stall()
    elif mode == "diverge":
        diverge(sys.argv[2])
    elif mode == "stale":
        stale(sys.argv[2], sys.argv[3:])
    elif mode == "wider":
        wider()
    elif mode == "generate":
        generate(Path(sys.argv[2]))
    elif mode == "saveload":
        saveload(Path(sys.argv[2]))
    else:
        raise SystemExit(f"unknown mode {mode}")
