"""Multi-process runs: joining through `jax.distributed`, and the rows of a global batch each process owns.

zerojax adds no transport. Every process calls `start` once, before JAX starts its backends; from
then on `jax.devices()` lists every process's devices and a jitted step spans them all. Where the
coordinates come from, first match per value:

1. the config's `distributed` section (`coordinator_address`, `num_processes`, `process_id`);
2. `ZEROJAX_*` environment variables (what `zerojax launch` sets for each process);
3. DeepSpeed's / torchrun's `MASTER_ADDR` + `MASTER_PORT`, `WORLD_SIZE`, `RANK`, `LOCAL_RANK`;
4. a cluster JAX recognises by itself: SLURM (`srun`), Open MPI (`mpirun`), a Kubernetes indexed
   Job, a multi-host Cloud TPU slice. There JAX also finds the coordinator.

A global batch has one row order whatever the number of processes (DeepSpeed's: see step.py), and
each process builds only the rows its own devices hold (`local_rows`, `global_array`).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import threading
from typing import Any, Callable, Iterator, Mapping

import jax
import numpy as np

from zerojax.config import Config, DistributedConfig
from zerojax.errors import ConfigError

# What `zerojax launch` sets (and what a hand-written launcher may set).
ENV_COORDINATOR = "ZEROJAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "ZEROJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "ZEROJAX_PROCESS_ID"
ENV_LOCAL_RANK = "ZEROJAX_LOCAL_RANK"
ENV_LOCAL_SIZE = "ZEROJAX_LOCAL_SIZE"
ENV_DEVICES_PER_PROCESS = "ZEROJAX_DEVICES_PER_PROCESS"


class DistributedError(RuntimeError):
    """The processes could not join (coordinator unreachable, a process missing, JAX already started)."""


@dataclasses.dataclass(frozen=True)
class Processes:
    """Who this process is in a multi-process run; None fields are left to JAX's cluster detection."""
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    local_rank: int | None = None       # index among the processes on this host
    local_size: int | None = None       # processes on this host
    devices_per_process: int | None = None
    origin: str = ""                    # where the values came from, for messages

    def local_device_ids(self) -> list[int] | None:
        """Accelerators this process drives (ignored on CPU); None: JAX's default.

        With `devices_per_process` K, local rank r drives devices [r*K, (r+1)*K). A cluster
        launcher with one process per host gets every local device (JAX alone would give it only
        device `local_rank`, i.e. one GPU): an empty list tells JAX not to restrict them.
        """
        if self.devices_per_process is not None and self.local_rank is not None:
            k = self.devices_per_process
            return list(range(self.local_rank * k, (self.local_rank + 1) * k))
        if self.local_size == 1 and self.origin in _CLUSTERS:
            return []
        return None


_CLUSTERS = ("SLURM", "Open MPI", "Kubernetes", "Cloud TPU")


def _int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r}: expected an integer") from None


def _cluster(environ: Mapping[str, str]) -> Processes | None:
    """A multi-process job started by a cluster launcher JAX can bootstrap from (coordinator left to JAX)."""
    if all(k in environ for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")):
        n = _int(environ, "SLURM_STEP_NUM_TASKS") or _int(environ, "SLURM_NTASKS")
        nodes = _int(environ, "SLURM_STEP_NUM_NODES") or _int(environ, "SLURM_NNODES")
        local = n // nodes if n and nodes and n % nodes == 0 else None
        return Processes(None, n, _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_LOCALID"), local,
                         origin="SLURM")
    if "OMPI_MCA_orte_hnp_uri" in environ:
        return Processes(None, _int(environ, "OMPI_COMM_WORLD_SIZE"), _int(environ, "OMPI_COMM_WORLD_RANK"),
                         _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK"), _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE"),
                         origin="Open MPI")
    if "KUBERNETES_SERVICE_HOST" in environ and "JOB_COMPLETION_INDEX" in environ:
        return Processes(None, None, None, origin="Kubernetes")
    hosts = environ.get("TPU_PROCESS_ADDRESSES") or environ.get("TPU_WORKER_HOSTNAMES") or ""
    if "," in hosts:
        return Processes(None, None, None, origin="Cloud TPU")
    return None


def resolve(dist: DistributedConfig, environ: Mapping[str, str] | None = None) -> Processes | None:
    """This process's place in a multi-process run, or None for a single-process run.

    Pure (reads only `dist` and `environ`), so every source can be tested without starting JAX.
    """
    environ = os.environ if environ is None else environ
    if dist.join == "never":
        return None
    # DeepSpeed's / torchrun's variables count only as a complete set: a stray RANK in an image's
    # environment must not turn a single-process run into an error.
    torch_env = all(environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"))
    master = f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}" if torch_env else None
    # (value, where it came from) per field, first match wins.
    sources: dict[str, list[tuple[Any, str]]] = {
        "coordinator_address": [(dist.coordinator_address, "distributed.coordinator_address"),
                                (environ.get(ENV_COORDINATOR) or None, ENV_COORDINATOR),
                                (master, "MASTER_ADDR/MASTER_PORT")],
        "num_processes": [(dist.num_processes, "distributed.num_processes"),
                          (_int(environ, ENV_NUM_PROCESSES), ENV_NUM_PROCESSES),
                          (_int(environ, "WORLD_SIZE") if torch_env else None, "WORLD_SIZE")],
        "process_id": [(dist.process_id, "distributed.process_id"),
                       (_int(environ, ENV_PROCESS_ID), ENV_PROCESS_ID),
                       (_int(environ, "RANK") if torch_env else None, "RANK")],
    }
    chosen: dict[str, tuple[Any, str]] = {}
    for name, options in sources.items():
        for value, where in options:
            if value is not None:
                chosen[name] = (value, where)
                break
    cluster = _cluster(environ)
    local_rank = _int(environ, ENV_LOCAL_RANK)
    if local_rank is None and torch_env:
        local_rank = _int(environ, "LOCAL_RANK")
    local_size = _int(environ, ENV_LOCAL_SIZE)
    if local_size is None and torch_env:
        local_size = _int(environ, "LOCAL_WORLD_SIZE")
    per_process = _int(environ, ENV_DEVICES_PER_PROCESS)
    if per_process is not None and per_process < 1:
        raise ConfigError(f"{ENV_DEVICES_PER_PROCESS}={per_process}: must be at least 1")

    if chosen:
        if cluster is not None:
            # Explicit values override the cluster's, the cluster fills what is missing.
            for name in ("num_processes", "process_id"):
                if name not in chosen and getattr(cluster, name) is not None:
                    chosen[name] = (getattr(cluster, name), cluster.origin)
            local_rank = local_rank if local_rank is not None else cluster.local_rank
            local_size = local_size if local_size is not None else cluster.local_size
        missing = [n for n in sources if n not in chosen and not (cluster is not None and n == "coordinator_address")]
        if missing:
            given = ", ".join(f"{n} (from {w})" for n, (_, w) in chosen.items())
            env = {"coordinator_address": ENV_COORDINATOR, "num_processes": ENV_NUM_PROCESSES,
                   "process_id": ENV_PROCESS_ID}
            raise ConfigError(
                f"distributed.{missing[0]}: a multi-process run needs coordinator_address, num_processes and "
                f"process_id, but only {given} {'is' if len(chosen) == 1 else 'are'} given; set "
                f"{' and '.join(env[m] for m in missing)} (or distributed.{missing[0]}), or start the processes "
                f"with `zerojax launch -n N`")
        num, num_from = chosen["num_processes"]
        pid, pid_from = chosen["process_id"]
        if num < 1:
            raise ConfigError(f"{num_from}: num_processes is {num}; it must be at least 1")
        if not 0 <= pid < num:
            raise ConfigError(f"{pid_from}: process_id {pid} is outside 0..{num - 1} "
                              f"(num_processes {num} from {num_from})")
        if num == 1 and dist.join != "always":
            return None
        coordinator = chosen.get("coordinator_address", (None, ""))[0]
        origin = "zerojax launch" if chosen["process_id"][1] == ENV_PROCESS_ID else pid_from
        return Processes(coordinator, num, pid, local_rank, local_size, per_process, origin=origin)

    if cluster is not None:
        if cluster.num_processes == 1 and dist.join != "always":
            return None
        return dataclasses.replace(cluster, devices_per_process=per_process)
    if dist.join == "always":
        return Processes(None, None, None, local_rank, local_size, per_process, origin="JAX cluster detection")
    return None


def cpu_devices_per_process(config: Config, procs: Processes | None) -> int | None:
    """Virtual CPU devices this process asks for: the job's `mesh.cpu_devices` split over the processes.

    So `zerojax launch -n 2` of a config written for 8 devices trains on the same 8-device mesh
    (4 per process) and gives the same result as one process. `--devices-per-process` overrides.
    """
    total = config.mesh.cpu_devices
    if procs is None:
        return total
    if procs.devices_per_process is not None:
        return procs.devices_per_process
    if total is None or procs.num_processes is None:
        return total
    if total % procs.num_processes:
        raise ConfigError(f"mesh.cpu_devices: {total} devices do not split evenly over {procs.num_processes} "
                          f"processes; set mesh.cpu_devices to a multiple of {procs.num_processes} or pass "
                          f"--devices-per-process to zerojax launch")
    return total // procs.num_processes


def start(config: Config | None = None, *, environ: Mapping[str, str] | None = None) -> Processes | None:
    """Join the multi-process run this process belongs to (None: a single-process run).

    Call it first, before any JAX computation: it also asks for this process's share of
    `mesh.cpu_devices` on a CPU machine. Calling it again in the same process is harmless.
    """
    from zerojax.core.mesh import request_cpu_devices

    dist = config.distributed if config is not None else DistributedConfig()
    procs = resolve(dist, environ)
    if config is not None:
        request_cpu_devices(cpu_devices_per_process(config, procs))
    elif procs is not None and procs.devices_per_process is not None:
        request_cpu_devices(procs.devices_per_process)
    if procs is None or jax.distributed.is_initialized():
        return procs
    arm_collective_timeout(dist.hang_timeout)
    where = procs.coordinator_address or f"the coordinator {procs.origin} names"
    try:
        jax.distributed.initialize(
            coordinator_address=procs.coordinator_address, num_processes=procs.num_processes,
            process_id=procs.process_id, local_device_ids=procs.local_device_ids(),
            initialization_timeout=dist.initialization_timeout)
    except Exception as e:  # JAX raises RuntimeError / ValueError / XlaRuntimeError here
        raise DistributedError(
            f"process {procs.process_id if procs.process_id is not None else '?'} of "
            f"{procs.num_processes or '?'} ({procs.origin}) could not join {where} within "
            f"distributed.initialization_timeout={dist.initialization_timeout} s: {e}\n"
            f"Check that every process was started with the same coordinator address and process count, "
            f"that process 0 can listen on that port, and that start() runs before any JAX computation."
        ) from e
    if config is not None and dist.check_consistency:
        check_consistency(config)  # the config as resolved, before anything of it runs
    return procs


def arm_collective_timeout(seconds: float, environ: Any = None) -> None:
    """On GPU, XLA waits inside a stuck NCCL collective forever by default
    (`xla_gpu_nccl_termination_timeout_seconds` is -1): give it `distributed.hang_timeout`, so such a
    collective ends the process with an error instead. Set before the backend starts, unless XLA_FLAGS
    already names it; CPU and TPU backends ignore the flag."""
    environ = os.environ if environ is None else environ
    flags = environ.get("XLA_FLAGS", "")
    if "xla_gpu_nccl_termination_timeout_seconds" not in flags and seconds > 0:
        environ["XLA_FLAGS"] = f"{flags} --xla_gpu_nccl_termination_timeout_seconds={int(seconds)}".strip()


def is_primary() -> bool:
    """Process 0 prints, shows progress and writes metrics; every process writes its checkpoint shards."""
    return jax.process_index() == 0


# ---------------------------------------------------------------------------------------------
# Rows of a global batch.

def local_rows(sharding: jax.sharding.Sharding, rows: int) -> np.ndarray:
    """Indices of the rows of a (`rows`, ...) array that this process's devices hold, ascending.

    This is also the order `jax.make_array_from_process_local_data` expects the local rows in.
    """
    indices = sharding.addressable_devices_indices_map((rows,))
    owned: set[int] = set()
    for index in indices.values():
        owned.update(range(*index[0].indices(rows)))
    return np.array(sorted(owned), dtype=np.int64)


def global_array(x: Any, sharding: jax.sharding.Sharding, rows: int | None = None) -> jax.Array:
    """A global array of `rows` rows from host data that is either all rows or this process's rows.

    With one process both are the same. With several, each process passes only its own rows
    (`local_rows`), or the whole batch, of which it keeps its own.
    """
    x = np.asarray(x)
    if x.ndim == 0:
        raise ValueError("batch leaves must have a leading batch dimension; got a scalar")
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    if rows is None:
        rows = _global_rows(sharding, x.shape[0])
    mine = local_rows(sharding, rows)
    if x.shape[0] == rows:
        x = x[mine]
    elif x.shape[0] != len(mine):
        raise ValueError(f"batch: process {jax.process_index()} has {x.shape[0]} rows; expected its own "
                         f"{len(mine)} rows of the global {rows} (or all {rows})")
    return jax.make_array_from_process_local_data(sharding, x, (rows, *x.shape[1:]))


def _global_rows(sharding: jax.sharding.Sharding, local: int) -> int:
    """The global row count when each process holds `local` rows under a uniform row sharding."""
    probe = sharding.num_devices * local  # any multiple of the device count works as a probe
    share = len(local_rows(sharding, probe))
    if not share or (local * probe) % share:
        raise ValueError(f"batch: {local} rows per process do not fit the {sharding.num_devices}-device layout")
    return local * probe // share


# ---------------------------------------------------------------------------------------------
# Steps in flight.

class InFlight:
    """At most `depth` dispatched steps not yet finished on this process of a multi-process run.

    JAX dispatches a jitted step and returns before it runs. A process that never reads a result
    (every process but 0, which alone logs) would otherwise queue steps without bound ahead of the
    others, and on CPU the queued steps' gloo collectives then run with the processes far apart: a
    reduce-scatter gives up after gloo's 30 s read timeout on one process (the error stays inside the
    queued arrays) while the other waits in its all-gather forever - the silent hang of
    `zerojax launch -n 2 train.py`. Waiting for step N-depth before returning from step N keeps
    every process within `depth` steps of its own device work, whatever it logs. One process: free.
    """

    def __init__(self, depth: int = 1):
        self.depth = depth
        self._steps: collections.deque[Any] = collections.deque()

    def add(self, outputs: Any) -> None:
        """Record a just-dispatched step by (some of) its outputs; wait for the oldest beyond `depth`."""
        if jax.process_count() == 1:
            return
        self._steps.append(outputs)
        while len(self._steps) > self.depth:
            jax.block_until_ready(self._steps.popleft())


# ---------------------------------------------------------------------------------------------
# Agreement between processes.

def broadcast_text(text: str) -> str:
    """Process 0's `text`, on every process (e.g. the output folder process 0 chose)."""
    if jax.process_count() == 1:
        return text
    from jax.experimental import multihost_utils

    data = np.frombuffer(text.encode(), dtype=np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int32(len(data))))
    buf = np.zeros(size, np.uint8)
    if is_primary():
        buf[:] = data
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))).decode()


def fingerprint(config: Config, abstract_params: Any) -> dict[str, Any]:
    """What must be equal on every process: the config (less the process's own id) and the model's
    parameter names, shapes and dtypes."""
    cfg = config.to_dict()
    cfg.get("distributed", {}).pop("process_id", None)
    leaves = {jax.tree_util.keystr(path): [list(x.shape), np.dtype(x.dtype).name]
              for path, x in jax.tree_util.tree_leaves_with_path(abstract_params)}
    return {"config": cfg, "model": {"structure": str(jax.tree.structure(abstract_params)), "leaves": leaves}}


def config_items(config: Config) -> dict[str, Any]:
    """The config as dotted keys and JSON values, less what differs by design between processes."""
    return {k: v if isinstance(v, (str, int, float, bool, type(None))) else json.dumps(v, default=str)
            for k, v in _flat(fingerprint(config, {})["config"]).items()}


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, Mapping):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def differences(mine: Mapping[str, Any], reference: Mapping[str, Any], limit: int = 10) -> list[str]:
    """Dotted keys whose values differ, as 'key: here X, process 0 Y' lines."""
    a, b = _flat(mine), _flat(reference)
    keys = sorted(set(a) | set(b))
    lines = [f"{k}: here {json.dumps(a.get(k, '<missing>'))}, process 0 {json.dumps(b.get(k, '<missing>'))}"
             for k in keys if a.get(k, "<missing>") != b.get(k, "<missing>")]
    return lines[:limit] + ([f"... and {len(lines) - limit} more"] if len(lines) > limit else [])


#: What a refusal tells the user to do.
_SAME_EVERYWHERE = ("Start every process with the same config file, --set values and code (a stale config file "
                    "on one host?); distributed.check_consistency: false skips this check (the step programs "
                    "are still compared before the first step).")


def check_consistency(config: Config, abstract_params: Any = None, plan: Any = None, *,
                      what: str = "distributed.check_consistency") -> None:
    """Raise `ProcessMismatch` on every process, naming the differing keys and processes, unless all hold
    the same config (less the process's own id), model structure and plan.

    Compared through `jax.distributed`'s key-value store, no collective: it runs before anything is
    compiled (and does not even start JAX's backends), so a mismatch cannot end in the transport's
    "collective mismatch" or a hang. Every process must call it at the same point. On by default
    (`distributed.check_consistency`).
    """
    from zerojax.runtime.agreement import agree_on_items, plan_items

    items = dict(config_items(config))
    if plan is not None:
        abstract_params = plan.abstract_params if abstract_params is None else abstract_params
        items.update(plan_items(plan))
    if abstract_params is not None:
        items["model.structure"] = str(jax.tree.structure(abstract_params))
        items.update({f"model{jax.tree_util.keystr(path)}": [list(x.shape), np.dtype(x.dtype).name]
                      for path, x in jax.tree_util.tree_leaves_with_path(abstract_params)})
    agree_on_items(what, items, timeout_s=config.distributed.hang_timeout or 300.0, fix=_SAME_EVERYWHERE)


def same_request(what: str, *request: Any) -> None:
    """Raise ValueError on every process unless all made the same `request` (e.g. one generate call's
    prompts and settings): a process that asked for another batch width or token count would compile
    another program and leave the others waiting in its collectives. One small all-gather."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    text = json.dumps(request, sort_keys=True, default=lambda x: np.asarray(x).tolist())
    digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), dtype=np.uint8)
    digests = np.asarray(multihost_utils.process_allgather(digest))
    bad = [p for p in range(digests.shape[0]) if not np.array_equal(digests[p], digests[0])]
    if bad:
        raise ValueError(f"{what}: process(es) {bad} asked for other inputs or settings than process 0; in a "
                         f"multi-process run every process passes the whole batch and the same settings (each gets "
                         f"every row back)")


def agreed(decide: Callable[[], str]) -> str:
    """Run `decide` on process 0 only (e.g. pick the output folder) and give every process its answer.

    A ConfigError raised by `decide` is raised on every process, so no process waits for the others
    in a collective they never reach.
    """
    if jax.process_count() == 1:
        return decide()
    answer = ""
    if is_primary():
        try:
            answer = "ok:" + decide()
        except ConfigError as e:
            answer = "error:" + str(e)
    answer = broadcast_text(answer)
    if answer.startswith("error:"):
        raise ConfigError(answer[len("error:"):])
    return answer[len("ok:"):]


# ---------------------------------------------------------------------------------------------
# Stopping together.

def stop_requested(step: int) -> bool:
    """Whether all processes agreed to stop after `step` because one of them got SIGTERM (or Ctrl-C,
    see `interrupts_as_preemption`). Call it once per step, with increasing steps, on every process."""
    if jax.process_count() == 1:
        return False
    from jax.experimental import multihost_utils
    try:
        return bool(multihost_utils.reached_preemption_sync_point(step))
    except RuntimeError:  # the preemption service is off (jax_enable_preemption_service=False)
        return False


@contextlib.contextmanager
def interrupts_as_preemption() -> Iterator[None]:
    """In a multi-process run, turn Ctrl-C into a preemption notice for the whole run.

    Each process would otherwise stop wherever SIGINT found it - some a step ahead of others, all
    then waiting in collectives forever. JAX's preemption service (started by
    jax.distributed.initialize) catches SIGTERM and agrees on one step for everybody; SIGINT is
    re-sent as SIGTERM so it takes the same path, and `stop_requested` reports that step.
    """
    if (jax.process_count() == 1 or threading.current_thread() is not threading.main_thread()
            or not jax.config.jax_enable_preemption_service):  # without it SIGTERM would just kill
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: os.kill(os.getpid(), signal.SIGTERM))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
