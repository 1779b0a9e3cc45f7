"""A thin DeepSpeed-shaped engine over the pure plan / state / step functions.

It holds the state and the compiled steps and answers DeepSpeed's accessors; all maths lives in
step.py. Porting code keeps its shape:

    engine = zerojax.initialize(ds_config, params=params, loss_fn=loss_fn)
    for batch in data:
        metrics = engine.train_batch(batch)
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from zerojax.config import Config, load_config
from zerojax.engine.deepspeed_api import DeepSpeedAPI
from zerojax.runtime.agreement import agree_on_program
from zerojax.runtime.distributed import InFlight, check_consistency, config_items, global_array, same_request
from zerojax.errors import LossScaleError, NonFiniteError
from zerojax.models.generate import Decoder, Generation, generate, pad_prompts
from zerojax.core.layout import MemoryReport, Plan
from zerojax.core.measure import release_freed_heap
from zerojax.planner.api import check_origin
from zerojax.planner.plan import make_plan
from zerojax.optim.deepspeed import ClientOptimizer, ScheduleFn
from zerojax.core.nonfinite import compile_finite_flags, float_leaves
from zerojax.core.nvme_step import NvmeStep
from zerojax.core.param_swap import ParamSwapStep
from zerojax.core.precision import LossScaleState, update_loss_scale
from zerojax.core.state import TrainState, abstract_state, init_state, logical_params
from zerojax.rewrite import prepare_loss
from zerojax.core.step import (LossFn, check_batch, check_eval_batch, checked_kernels, make_eval_step,
                               make_train_step)

if TYPE_CHECKING:
    from zerojax.checkpoint import PendingSave

# Steps that keep part of the state in swap files between calls: `store` writes a whole state out and
# returns what the step carries, `full` reads it back.
_SWAPPING = (NvmeStep, ParamSwapStep)


def set_log_level(level: str) -> None:
    """The `zerojax` logger and its handlers at `level` (debug ... critical), as DeepSpeed's engine sets its
    own logger from `log_level` when it starts (utils/logging.set_log_level_from_string)."""
    logger = logging.getLogger("zerojax")
    number = logging.getLevelName(level.upper())
    logger.setLevel(number)
    for handler in logger.handlers:
        handler.setLevel(number)


def agree_before_compiling(config: Config, plan: Plan) -> None:
    """Every process of a multi-process run holds this config and plan (`distributed.check_consistency`),
    checked before the engine compiles anything (the kernels' self-check, the state's initialisation):
    a mismatch is refused on every process, naming the keys, instead of in the first collective."""
    if config.distributed.check_consistency:
        check_consistency(config, plan=plan, what="zerojax.initialize")


@contextlib.contextmanager
def compiling_ahead(train_step: Any, plan: Plan, batch: Any,
                    finite_leaves: list[Any] | None = None) -> Iterator[concurrent.futures.Executor | None]:
    """Compile `train_step` for the fresh state and `batch` in a thread while the body runs (the
    state's initialisation: its own compile, then its run). Both compiles are mostly XLA's, which runs
    without the GIL, so the two overlap instead of adding up; the executable lands in JAX's caches,
    where the first call with the real state finds it. An error of the step's compile is raised here.
    `finite_leaves` (the state's float leaves, abstract): the finiteness check compiles for them on a
    second thread from the start, while this thread traces the step, and is not waited for here.
    Yields the threads' pool (None without `batch`): what the body queues there is not waited for
    either; `compile_finite_flags`' users wait for their program."""
    if batch is None:
        yield None
        return
    rows = plan.batch.train_batch_size
    spec = jax.tree.map(lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(
        (rows, *np.shape(x)[1:]), np.asarray(x).dtype, sharding=plan.batch_sharding), batch)
    pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="zerojax-compile")
    try:
        if finite_leaves is not None:
            compile_finite_flags(plan.replicated, finite_leaves, pool)
        # Traced and lowered here (Python, holding the GIL: traced beside the state's program, each
        # would wait on the other), so the step's XLA compile, the longer one, starts first.
        lowered = train_step.lower(abstract_state(plan), spec)
        compiled = pool.submit(lowered.compile)
        yield pool
        compiled.result()
    finally:
        pool.shutdown(wait=False)  # queued work still runs; its users wait for it


class Engine(DeepSpeedAPI):
    """Training state plus compiled train/eval steps for one config, mesh and model."""

    def __init__(self, config: Config | Mapping[str, Any] | str, params: Any, loss_fn: LossFn, mesh: Mesh, *,
                 optimizer: ClientOptimizer | None = None, lr_scheduler: ScheduleFn | None = None,
                 layer_axes: Any = None, plan: Plan | None = None, decode: Decoder | None = None,
                 tensor_dims: Any = None, trainable: Any = None, compile_for: Any = None):
        """`plan`: one already made from this config and mesh (`zerojax.plan`), so it is not made twice;
        without it the engine makes its own from `optimizer`, `lr_scheduler`, `layer_axes` and `tensor_dims`.
        `decode`: the model's KV-cache forward (`zerojax.models.generate.Decoder`: `init_cache`, `prefill`,
        `decode_step` over these params), which `generate` runs; train.py passes the shipped GPT's or
        Llama's (`zerojax.models.decode.decoder(config.model)`). `trainable`: `zerojax.plan`'s (which
        leaves are trained: a bool tree, or an NNX Variable class such as `nnx.LoRAParam`). `compile_for`: a
        batch like the ones `train_batch` will take (host arrays or `jax.ShapeDtypeStruct`s of the global
        batch): its train step compiles in a thread while the state's own program compiles and runs (XLA
        compiles without holding the GIL), so the first `train_batch` finds it compiled."""
        self.decoder = decode
        config = load_config(config)  # a Config, a dict or a file path, as `initialize` takes it
        if plan is None:
            plan = make_plan(config, mesh, params, optimizer=optimizer, lr_scheduler=lr_scheduler,
                             layer_axes=layer_axes, logical_axes=getattr(loss_fn, "logical_axes", None),
                             tensor_dims=tensor_dims, model_state=getattr(loss_fn, "model_state", None),
                             trainable=trainable, variable_types=getattr(loss_fn, "variable_types", None))
        else:
            if (optimizer is not None or lr_scheduler is not None or layer_axes is not None or tensor_dims is not None
                    or trainable is not None):
                raise TypeError("Engine: with plan= the optimizer, scheduler, layer axes and tensor splits are the "
                                "plan's; drop optimizer= / lr_scheduler= / layer_axes= / tensor_dims= / trainable= (or pass them "
                                "to zerojax.plan)")
            check_origin(config, plan, "Engine")
        agree_before_compiling(config, plan)
        plan = checked_kernels(plan)
        prepared = prepare_loss(plan, loss_fn)
        self._start(config, mesh, loss_fn, plan, params, make_train_step(plan, prepared), make_eval_step(plan, prepared),
                    compile_for)

    def _start(self, config: Config, mesh: Mesh, loss_fn: LossFn, plan: Plan, params: Any,
               train_step: Callable[[TrainState, Any], Any], eval_step: Callable[[Any, Any], jax.Array],
               compile_for: Any = None) -> None:
        """Everything an engine holds, whatever built its plan and steps (the pipeline engine too)."""
        self.config, self.mesh, self.loss_fn, self.plan = config, mesh, loss_fn, plan
        if config.log_level is not None:
            set_log_level(config.log_level)
        self._train_step, self._eval_step = train_step, eval_step
        # The finiteness check of the first fetch and every save compiles beside the step: from the
        # state's shapes, or, for a step that stores part of the state in files, from the stored state.
        early = None if isinstance(train_step, _SWAPPING) else [x for *_, x in float_leaves(abstract_state(plan))]
        with compiling_ahead(train_step, plan, compile_for, early) as pool:
            self.state: TrainState = self._stored(init_state(plan, params))
            if pool is not None and early is None:
                compile_finite_flags(plan.replicated, [x for *_, x in float_leaves(self.state)], pool)
        self._pending: PendingSave | None = None
        self._in_flight = InFlight()  # multi-process: no process runs steps ahead of its devices
        self._risk_fn: Callable[[LossScaleState, jax.Array], jax.Array] | None = None
        self.loaded_extra: dict[str, Any] = {}
        self._start_trio()
        self._agreed_steps: set[str] = set()  # steps whose programs every process has compared
        self._last_metrics: dict[str, jax.Array] | None = None
        # A run imported from a transformers checkpoint records what it read, so `zerojax export --format hf`
        # can give back the tensors the model does not train (read now: the folder as it was imported).
        self._hf_source: dict[str, Any] | None = None
        if config.model.hf_checkpoint:
            from zerojax.models.hf import source_record
            self._hf_source = source_record(config.model.hf_checkpoint)

    def _stored(self, state: TrainState) -> TrainState:
        """A whole state as the step carries it: with the optimizer state on NVMe, written to the step's
        files and returned slim (`core.nvme_step`; the parameters on NVMe: `core.param_swap`); otherwise
        unchanged."""
        return self._train_step.store(state) if isinstance(self._train_step, _SWAPPING) else state

    def _live_params(self) -> Any:
        """The stored parameters on the devices: read from the NVMe files when they live there."""
        step = self._train_step
        return step.live(self.state).params if isinstance(step, ParamSwapStep) else self.state.params

    def whole_state(self) -> TrainState:
        """The state with every field present: the master copy and optimizer moments read back from the
        NVMe files when the optimizer state lives there (checkpoints save this), else `self.state`."""
        return self._train_step.full(self.state) if isinstance(self._train_step, _SWAPPING) else self.state

    # -- training ---------------------------------------------------------------------------
    def place_batch(self, batch: Any, rows: int | None = None) -> Any:
        """`batch` on the devices in the plan's batch sharding, without running a step (a data
        loader can place the next batch while the current step runs). Host rows go straight to their
        data shard; arrays already on devices pass through.

        In a multi-process run a host batch holds this process's rows of the global batch (the
        ones `zerojax.runtime.distributed.local_rows` names), or all of them.
        """
        sharding = self.plan.batch_sharding
        return jax.tree.map(lambda x: x if isinstance(x, jax.Array) else global_array(x, sharding, rows), batch)

    def _checked(self, batch: Any, check: Callable[[Plan, Any], None], rows: int | None = None) -> Any:
        """`batch` placed on the devices, its shape checked once: on the host rows before any transfer
        when this process holds the whole batch, on the global array when each process holds a part."""
        if jax.process_count() == 1:
            check(self.plan, batch)
            return self.place_batch(batch, rows)
        batch = self.place_batch(batch, rows)
        check(self.plan, batch)
        return batch

    def train_batch(self, batch: Any) -> dict[str, jax.Array]:
        """One optimizer step on a global batch (leading dimension train_batch_size; in a
        multi-process run, host data may hold only this process's rows).

        Returns once the step is dispatched and the previous one has finished, so the host builds
        and sends the next batch while this step runs (`dispatch_ahead`). With dynamic fp16 an
        overflow at the minimum loss scale still raises `LossScaleError` from the call of the very
        step that overflowed, as DeepSpeed does. A non-finite loss or gradient is skipped (counted in
        `skipped_steps`) and `run.non_finite_limit` of them in a row raise `NonFiniteError` from the
        call of the step that reached the limit; with `run.non_finite: stop` the step is applied and
        the next call raises, naming the step and the first non-finite leaf.
        """
        batch = self._checked(batch, check_batch, self.plan.batch.train_batch_size)
        risk = self._stuck_risk() if self.dispatch_ahead else None  # read before the step donates the state
        previous = self._last_metrics
        step = self._agreed("train step", self._train_step, self.state, batch)
        self.state, metrics = step(self.state, batch)
        self._in_flight.add(metrics)
        self._last_metrics = metrics
        if not self.dispatch_ahead:
            jax.block_until_ready(metrics)
        # Only a step whose input scale already sits at the minimum with its hysteresis spent can set
        # `stuck` (precision.update_loss_scale), so the host waits for this step's flag only then;
        # otherwise it waits for the previous step alone (`risk` is its output). Healthy runs stay one
        # step ahead; a run at the minimum scale waits each step, and stops on the step that got stuck.
        if self.plan.scaler.dynamic and (risk is None or bool(risk)) and bool(self.state.scaler.stuck):
            # Should the caller catch this and train on, every later step is skipped (`stuck` is
            # sticky and forces the overflow path in step._overflow): nothing is applied, and the
            # next call raises again.
            raise LossScaleError(loss_scale_message(self.plan, self.state))
        self._check_non_finite(previous, metrics)
        return metrics

    def _check_non_finite(self, previous: dict[str, jax.Array] | None, metrics: dict[str, jax.Array]) -> None:
        """`run.non_finite`'s stop, read from the previous step's metrics (finished by now, so no extra
        wait) and from this step's only when it could be the one that reaches the limit."""
        sc = self.plan.scaler
        if sc.dynamic or "non_finite" not in metrics:
            return
        if sc.check_finite:
            if sc.limit and (previous is None or int(previous["skipped_streak"]) >= sc.limit - 1) \
                    and int(metrics["skipped_streak"]) >= sc.limit:
                raise NonFiniteError(non_finite_message(self.plan, self.state, int(metrics["skipped_streak"])))
        elif previous is not None and bool(previous["non_finite"]):
            raise NonFiniteError(non_finite_message(self.plan, self.state, 0))

    #: False: `train_batch` waits for its own step before returning (one host sync per step, the
    #: behaviour before dispatch-ahead); for timing comparisons and debugging.
    dispatch_ahead: bool = True

    def _stuck_risk(self) -> jax.Array | None:
        """Whether the next step could set the loss scaler's `stuck` flag (an overflow on it would),
        as a device array computed from the current state, dispatched without waiting."""
        if not self.plan.scaler.dynamic:
            return None
        if getattr(self, "_risk_fn", None) is None:
            cfg = self.plan.scaler

            def risk(scaler: LossScaleState, step: jax.Array) -> jax.Array:
                return update_loss_scale(cfg, scaler, jnp.asarray(True), step, ~scaler.first_bad).stuck

            self._risk_fn = jax.jit(risk)
        return self._risk_fn(self.state.scaler, self.state.step)

    def eval_batch(self, batch: Any) -> jax.Array:
        """Mean loss of `batch` (leading dimension a multiple of the data-parallel size)."""
        batch = self._checked(batch, check_eval_batch)
        args = (self._live_params(), batch) + (() if self.state.model_state is None else (self.state.model_state,))
        return self._agreed("eval step", self._eval_step, *args)(*args)

    def _agreed(self, name: str, fn: Any, *args: Any) -> Any:
        """`fn`, once every process of a multi-process run has shown it compiled the same program for
        these arguments (`runtime.agreement`): the first call of each step is compiled here and its
        executable used; a mismatch is refused on every process before any collective runs. The
        compiler's freed working memory is handed back before that first call runs, so the step's
        buffers do not stack on it in the host's peak (later calls reuse jit's cached executable, and
        a step compiled ahead by `compile_for` is found in that cache: one process compiles it once).
        `fn` follows JAX's ahead-of-time interface (`fn.lower(*args).compile()` is what to call), as
        the NVMe step of several programs does too (`core.nvme_step.Lowered`)."""
        if name in self._agreed_steps:
            return fn
        lowered = fn.lower(*args)
        compiled = lowered.compile()
        release_freed_heap()
        if jax.process_count() > 1:
            agree_on_program(name, lowered.as_text(), compiled.as_text(), config=config_items(self.config),
                             timeout_s=self.config.distributed.hang_timeout or 300.0)
        self._agreed_steps.add(name)
        return compiled  # a step of several programs (the NVMe optimizer's) compiles to the whole step

    @property
    def last_metrics(self) -> dict[str, jax.Array] | None:
        """The metrics of the latest `train_batch` (None before one): loss, grad_norm, lr, ..."""
        return self._last_metrics

    @property
    def train_step_fn(self) -> Callable[[TrainState, Any], Any]:
        """The jitted pure step, for `.lower(state, batch)` and HLO inspection."""
        return self._train_step

    # -- generation -------------------------------------------------------------------------
    #: The model's KV-cache forward (`Engine(decode=...)`); None: `generate` explains what to pass.
    decoder: Decoder | None = None

    def generate(self, prompts: Any, max_new_tokens: int, *, lengths: Any = None, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                 eos_id: int | None = None, attention_mask: Any = None, stop_ids: Sequence[int] | None = None,
                 pad_id: int | None = None) -> Generation:
        """New tokens after each prompt from the live training weights (`zerojax.models.generate`).

        `prompts`: a list of token lists; an int array [B, T] right-padded with `lengths` [B]; or an
        array with an `attention_mask` [B, T], left-padded as transformers' `generate` takes it (or
        right-padded). Greedy at temperature 0, else sampled (`top_k`, `top_p`, `seed`); a row stops
        at `eos_id` or any of `stop_ids`, and `pad_id` (default `eos_id`) fills the rest of it.
        Returns tokens, log-probabilities (of the model at temperature 1) and lengths (`Generation`),
        and `.sampled_logprobs` (of the distribution the tokens were drawn from).
        The parameters are read where the ZeRO stage keeps them (`state.params`, the compute dtype),
        in the layout `zerojax.models.decode_layout.choose` picks per call: `tensor` (the weights stay
        in the plan's blocks, activations move) or `layers` (each device decodes its rows, each
        stage-3 shard gathered where its layer uses it); neither holds a whole copy of the model,
        and nothing of the state changes. `memory_report` says which ran and its compiled peak.
        Prompt widths and new-token counts round up to powers of two (at least 8), so a loop whose
        shapes vary compiles a few programs, not one per call.
        In a multi-process run every process passes the same prompts and settings (checked: a
        difference is an error on every process, not a hang) and every process gets every row.
        """
        if self.decoder is None:
            raise TypeError("generate: this engine has no decoder; pass decode= to zerojax.initialize(...) or "
                            "Engine(...): an object with init_cache / prefill / decode_step over these params "
                            "(zerojax.models.generate.Decoder), e.g. zerojax.models.decode.decoder(model_config) for "
                            "the shipped GPT or Llama; zerojax.from_hf(path, config) passes it for you")
        prompts, lengths = pad_prompts(prompts, lengths, attention_mask)
        bound = self.config.hybrid_engine.max_out_tokens
        widest = int(np.max(lengths, initial=0))
        if widest + max_new_tokens > bound:
            raise ValueError(f"generate: a prompt of {widest} tokens plus max_new_tokens={max_new_tokens} exceeds "
                             f"hybrid_engine.max_out_tokens={bound}; raise it in the config or ask for fewer tokens")
        if jax.process_count() > 1:
            same_request("generate", prompts, lengths, max_new_tokens, temperature, top_k, top_p, seed, eos_id,
                         stop_ids, pad_id)
        return generate(self.decoder, self._live_params(), prompts, lengths, max_new_tokens, temperature=temperature,
                        top_k=top_k, top_p=top_p, seed=seed, eos_id=eos_id, plan=self.plan, stop_ids=stop_ids,
                        pad_id=pad_id)

    # -- state ------------------------------------------------------------------------------
    @property
    def params(self) -> Any:
        """Logical (whole-shape) parameters: the fp32 master copy under mixed precision (read back from
        the NVMe files when it lives there)."""
        step, state = self._train_step, self.state
        if isinstance(step, ParamSwapStep):
            step, state = step.inner, step.live(state)
        if self.plan.policy.mixed and isinstance(step, NvmeStep):
            state = step.full(state, moments=False)  # the moments stay on NVMe
        return logical_params(state)

    @property
    def model_state(self) -> Any:
        """The model's state the step updates without differentiating it (NNX BatchNorm's running
        statistics, as a dict shaped like `nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))`); None
        for a model without. `zerojax.to_nnx(model, engine.state)` writes it back with the parameters."""
        return self.state.model_state

    @property
    def global_steps(self) -> int:
        return int(self.state.step)

    @property
    def skipped_steps(self) -> int:
        return int(self.state.skipped)

    def get_lr(self) -> list[float]:
        """The lr the next applied step will use (DeepSpeed returns one per param group)."""
        return [float(self.plan.schedule.lr(self.state.step - self.state.skipped))]

    def memory_report(self) -> MemoryReport:
        return self.plan.report()

    # -- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: Any = None, *,
                        extra: Mapping[str, Any] | None = None, async_save: bool | None = None,
                        exclude_frozen_parameters: bool = False, best: bool = False) -> str:
        """Save everything needed to continue bit for bit; returns the tag (`global_step{N}` by default).

        As in DeepSpeed, the save is complete and verifiable when this returns. `async_save=True`
        (or `checkpoint.async_save: true`) opts in to writing in the background while training goes
        on; the tag becomes `latest` only once complete, and a pending save is finished by the next
        save or load, `wait_for_checkpoint()`, deleting the engine, or interpreter exit. `extra`
        holds more JSON state (the trainer keeps its data position there). Relative paths are fine.
        `exclude_frozen_parameters` (DeepSpeed's): the frozen parameters are not written; the tag then
        loads into an engine that holds them (`load_checkpoint` takes them from this engine's state).
        `best` (zerojax): the folder's `.best` pointer names this tag once it is complete (train.py's lowest
        validation loss); retention never deletes that tag.
        """
        from zerojax import checkpoint  # orbax is imported only when checkpoints are used
        cfg = self.config.checkpoint
        if tag is not None and cfg.tag_validation != "Ignore" and jax.process_count() > 1:
            from zerojax.runtime.distributed import broadcast_text
            validate_tag(tag, broadcast_text(tag), cfg.tag_validation)
        self.wait_for_checkpoint()
        self._pending = checkpoint.save(
            save_dir, tag, self.whole_state(), self.plan,
            extra={"client_state": client_state, "config": self.config.to_dict(),
                   **({"hf_source": self._hf_source} if getattr(self, "_hf_source", None) else {}), **(extra or {})},
            async_save=cfg.async_save if async_save is None else async_save,
            max_to_keep=cfg.max_to_keep, keep_every_n_steps=cfg.keep_every_n_steps,
            exclude_frozen=exclude_frozen_parameters, best=best)
        return self._pending.tag

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous save has completed (raises if it failed)."""
        pending, self._pending = getattr(self, "_pending", None), None
        if pending is not None:
            pending.wait()

    def __del__(self) -> None:
        """`del engine` (or losing the last reference) finishes a pending save rather than dropping it."""
        pending = getattr(self, "_pending", None)
        if pending is None or pending.done() and pending._error is None:
            return
        try:
            self.wait_for_checkpoint()
        except Exception as e:  # noqa: BLE001 - nothing can be raised from a finalizer; say it instead
            print(f"zerojax: {e}: {e.__cause__!r}", file=sys.stderr)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        ) -> tuple[str, Any]:
        """Restore a checkpoint onto this engine's mesh and stage; returns (path, client_state).

        The layout comes from this engine's plan, so a checkpoint from any mesh shape or ZeRO stage
        loads directly. The schedule position is derived from the restored step counters, so
        `load_lr_scheduler_states` is accepted for compatibility and always honoured as True.
        """
        from zerojax import checkpoint
        del load_lr_scheduler_states
        self.wait_for_checkpoint()
        state, extra = checkpoint.load(load_dir, tag, self.plan, load_optimizer_states=load_optimizer_states,
                                       load_module_only=load_module_only, frozen=self._live_params())
        self.state = self._stored(state)
        self.loaded_extra = extra
        resolved = tag or checkpoint.latest_tag(load_dir)
        return str(Path(load_dir) / str(resolved)), extra.get("client_state")

    # -- DeepSpeed accessors --------------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self.plan.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.plan.batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.plan.batch.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.plan.stage


def loss_scale_message(plan: Plan, state: TrainState) -> str:
    """Why the run cannot go on: the scale is at its minimum and gradients still overflow."""
    scaler = jax.device_get(state.scaler)
    paths = plan.trained_paths  # one flag per trainable leaf
    bad = [paths[i] for i in np.flatnonzero(scaler.first_bad)]
    shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
    return (f"fp16 gradients overflowed at step {int(state.step)} with the loss scale already at "
            f"fp16.min_loss_scale={plan.scaler.min_scale:g}: {int(scaler.streak)} consecutive steps "
            f"skipped; the first of them had non-finite gradients in {shown or 'no leaf (forced)'}. "
            f"Train with bf16.enabled: true instead of fp16 (no loss scaling needed), or lower the "
            f"learning rate / check the data for inf and NaN")


def non_finite_message(plan: Plan, state: TrainState, streak: int) -> str:
    """Where training went non-finite: the step, the first non-finite leaves, and what to change."""
    scaler = jax.device_get(state.scaler)
    paths = plan.trained_paths  # one flag per trainable leaf
    bad = [paths[i] for i in np.flatnonzero(scaler.first_bad)]
    where = (", ".join(bad[:6]) + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")) if bad else "the loss only"
    first = int(scaler.last_overflow) + 1 if streak == 0 else int(state.step) - streak + 1
    what = (f"{streak} consecutive steps skipped (run.non_finite_limit) with a non-finite loss or gradients, "
            f"the first at step {first}" if streak else f"a non-finite loss or gradients at step {first} (run.non_finite: stop)")
    return (f"{what}; non-finite first in {where}. Lower optimizer.params.lr (or warm it up), check the data "
            f"for inf and NaN, or raise run.non_finite_limit")


def validate_tag(mine: str, process0: str, mode: str) -> None:
    """DeepSpeed's `checkpoint.tag_validation`: every process must save under the same tag (a
    process given another tag would write a different checkpoint). Warn logs and goes on; Fail
    raises; Ignore does not compare."""
    if mode == "Ignore" or mine == process0:
        return
    message = (f"checkpoint.tag_validation: this process saves under tag '{mine}' but process 0 under "
               f"'{process0}'; pass the same tag on every process (or none: global_step<N>)")
    if mode == "Fail":
        raise ValueError(message)
    warnings.warn(message, UserWarning, stacklevel=3)
