"""DeepSpeedEngine's public surface for ported training scripts, on top of the one compiled step.

DeepSpeed scripts drive the engine per micro-batch:

    for batch in loader:
        loss = engine(batch)        # forward
        engine.backward(loss)
        engine.step()               # the optimizer steps at the accumulation boundary only

zerojax compiles the whole optimizer step (every micro-batch's forward and backward, the reduction
and the update) into one program, so the trio maps onto it: `engine(batch)` queues the micro-batch
and returns a `MicroBatchLoss`, `backward` checks it is the one just returned, and `step` runs the
compiled step when the accumulation boundary is reached (DeepSpeed's count: every
`gradient_accumulation_steps` micro-batches). The loss's value is known once that step has run
(`float(loss)`, `loss.item()`). In eval mode (`engine.eval()`), `engine(batch)` returns the loss at
once, as a forward under `torch.no_grad()` does.

Every other DeepSpeedEngine attribute a training script uses is either here with DeepSpeed's
meaning, or raises one AttributeError naming the zerojax way (`DEEPSPEED_ONLY`); docs/porting.md
lists them all.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from zerojax.core.mesh import data_size, row_size, sequence_size, tensor_size

__all__ = ["DeepSpeedAPI", "MicroBatchLoss", "DEEPSPEED_ONLY"]


class MicroBatchLoss:
    """The loss of one micro-batch, as `engine(batch)` returns it: a value once the optimizer step
    that contains the micro-batch has run (the accumulation boundary), an error before."""

    def __init__(self, engine: "DeepSpeedAPI", index: int, step: int):
        self._engine, self.index, self.step = engine, index, step

    def _value(self) -> float:
        done = self._engine._micro_losses.get(self.step)
        if done is None:
            raise RuntimeError(
                f"the loss of micro-batch {self.index + 1} of step {self.step} is known once engine.step() has run "
                f"that step ({self._engine.gradient_accumulation_steps()} micro-batches per step; zerojax computes "
                f"them in one compiled program); read it after engine.step(), or use engine.train_batch(batch) "
                f"for the whole step at once")
        return float(done[self.index])

    def item(self) -> float:
        return self._value()

    def __float__(self) -> float:
        return self._value()

    def detach(self) -> "MicroBatchLoss":  # scripts write loss.detach().item()
        return self

    def __format__(self, spec: str) -> str:
        return format(self._value(), spec)

    def __repr__(self) -> str:
        done = self._engine._micro_losses.get(self.step)
        return (f"MicroBatchLoss(step {self.step}, micro-batch {self.index + 1}, "
                f"{'%g' % float(done[self.index]) if done is not None else 'pending'})")


# DeepSpeedEngine attributes with no zerojax counterpart, and what to use instead.
DEEPSPEED_ONLY: dict[str, str] = {
    "module": "the parameters are engine.params (a pytree); for a Flax NNX model, zerojax.to_nnx(model, engine.params)",
    "optimizer": "the update is engine.plan.tx (an optax transformation); its state is engine.state.opt_state",
    "lr_scheduler": "the schedule is engine.plan.schedule.lr (a function of the update count); engine.get_lr() "
                    "gives the next step's lr",
    "training_dataloader": "zerojax takes batches, not a loader: engine.train_batch(batch), or "
                           "zerojax.runtime.data for train.py's loaders",
    "deepspeed_io": "build batches with numpy or grain and pass them to engine(batch) / engine.train_batch(batch)",
    "zero_grad": "gradients never outlive a step in zerojax (the compiled step accumulates and applies them); "
                 "there is nothing to zero",
    "allreduce_gradients": "the compiled step reduces gradients as the ZeRO stage says; call engine.step()",
    "clip_fp32_gradients": "clipping is gradient_clipping in the config, applied inside the step",
    "set_gradient_accumulation_boundary": "the boundary is every gradient_accumulation_steps micro-batches; "
                                          "use engine.train_batch(batch) to run a whole step at once",
    "no_sync": "gradients are reduced inside the compiled step; there is no separate sync to skip",
    "get_pld_theta": "progressive layer drop is not built (zerojax refuses its config section)",
    "save_16bit_model": "zerojax export RUN --format safetensors --dtype bf16 (or fp16) writes the weights "
                        "from a checkpoint, one leaf at a time",
    "save_fp16_model": "zerojax export RUN --format safetensors --dtype fp16",
    "compile": "the step is always compiled (jax.jit); nothing to call",
    "destroy": "del engine (a pending checkpoint save is finished first)",
    "empty_partition_cache": "ZeRO-3 gathers live inside the compiled step; nothing is cached between steps",
    "get_sequence_parallel_group": "collectives are named mesh axes, not process groups: the `sequence` axis "
                                   "of engine.mesh (engine.sequence_parallel_size devices)",
    "get_data_parallel_group": "collectives are named mesh axes, not process groups: engine.mesh.axis_names",
    "monitor": "train.py's monitors (tensorboard, csv, wandb, comet) write metrics.jsonl and events; "
               "engine.train_batch(batch) returns the metrics",
}


class DeepSpeedAPI:
    """DeepSpeedEngine's methods and accessors for a zerojax `Engine` (mixed into it)."""

    # -- the forward / backward / step trio ----------------------------------------------------
    def _start_trio(self) -> None:
        self._queued: list[Any] = []          # micro-batches of the step being gathered
        self._backwarded = 0                  # of those, how many went through backward()
        self._micro_losses: dict[int, np.ndarray] = {}  # step -> each micro-batch's loss
        self._training = True
        self.micro_steps = 0                  # micro-batches through engine.step() (DeepSpeed's count)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the micro-batch being processed ends an optimizer step (DeepSpeed's count)."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def forward(self, batch: Any) -> Any:
        """One micro-batch (`train_micro_batch_size_per_gpu` x data-parallel rows; in a multi-process
        run, this process's rows): queued for the step, its loss returned as a `MicroBatchLoss`. In
        eval mode, the micro-batch's mean loss at once."""
        if not self._training:
            return self.eval_batch(batch)
        if len(self._queued) > self._backwarded:
            raise RuntimeError("engine(batch): the previous micro-batch has not been through engine.backward(loss); "
                               "call engine(batch), engine.backward(loss), engine.step() in that order")
        self._queued.append(batch)
        return MicroBatchLoss(self, len(self._queued) - 1, self.global_steps + 1)

    __call__ = forward

    def backward(self, loss: Any, retain_graph: bool = False, scale_wrt_gas: bool = True) -> Any:
        """Marks the micro-batch's backward pass, which runs inside the compiled step. The loss must
        be the one `engine(batch)` just returned (a loss computed elsewhere has no gradient here).
        `scale_wrt_gas` is DeepSpeed's default (the loss divided by the accumulation steps)."""
        del retain_graph
        if not scale_wrt_gas:
            raise ValueError("backward(scale_wrt_gas=False): zerojax always averages the micro-batches' gradients "
                             "over the accumulation steps, as DeepSpeed's default does")
        if not isinstance(loss, MicroBatchLoss) or loss._engine is not self or \
                loss.index != len(self._queued) - 1 or self._backwarded != len(self._queued) - 1:
            raise RuntimeError("engine.backward(loss): pass the loss engine(batch) returned for the current "
                               "micro-batch; zerojax differentiates the engine's own loss function")
        self._backwarded += 1
        return loss

    def step(self, lr_kwargs: Any = None) -> None:
        """At the accumulation boundary: the compiled optimizer step over the queued micro-batches
        (in DeepSpeed's order: micro-batch i is rows [i*m*dp, (i+1)*m*dp) of the global batch).
        Between boundaries nothing runs, as DeepSpeed's step() only counts."""
        del lr_kwargs
        if self._backwarded != len(self._queued):
            raise RuntimeError("engine.step(): a micro-batch went through engine(batch) but not engine.backward(loss)")
        self.micro_steps += 1  # DeepSpeed counts the micro-step here, at the end of its step()
        if len(self._queued) < self.gradient_accumulation_steps():
            return
        batch = jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *self._queued)
        self._queued, self._backwarded = [], 0
        step = self.global_steps + 1
        metrics = self.train_batch(batch)
        losses = metrics.get("micro_losses", None)
        if losses is None:  # a pipeline's step reports the mean loss only
            losses = np.full(self.gradient_accumulation_steps(), float(jax.device_get(metrics["loss"])))
        self._micro_losses = {step: np.asarray(jax.device_get(losses))}

    def train(self, mode: bool = True) -> "DeepSpeedAPI":
        """Training mode: `engine(batch)` queues micro-batches for the step (DeepSpeed: module.train())."""
        self._training = mode
        return self

    def eval(self) -> "DeepSpeedAPI":
        """Eval mode: `engine(batch)` returns the batch's loss at once, without dropout."""
        return self.train(False)

    # -- after a step ----------------------------------------------------------------------------
    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last step (after unscaling, before clipping); None before one."""
        return None if self._last_metrics is None else float(jax.device_get(self._last_metrics["grad_norm"]))

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step updated the parameters (False when it was skipped: an fp16
        overflow or non-finite gradients)."""
        return self._last_metrics is not None and not bool(jax.device_get(self._last_metrics["skipped"]))

    def get_mom(self) -> list[tuple[float, float]]:
        """(beta1, beta2) the next step uses, one pair per param group (DeepSpeed's get_mom); NaN for
        an optimizer without betas."""
        sched, position = self.plan.schedule, self.state.step - self.state.skipped
        betas = getattr(getattr(self.config.optimizer, "params", None), "betas", None) or (float("nan"),) * 2
        b1 = float(sched.beta1(position)) if sched.beta1 is not None else float(betas[0])
        b2 = float(sched.beta2(position)) if sched.beta2 is not None else float(betas[1])
        return [(b1, b2)]

    @property
    def global_samples(self) -> int:
        return self.global_steps * self.train_batch_size()

    # -- where this process stands -----------------------------------------------------------
    @property
    def global_rank(self) -> int:
        """This process's index (DeepSpeed's rank; one zerojax process drives all its host's devices)."""
        return jax.process_index()

    @property
    def local_rank(self) -> int:
        """This process's index on its host (LOCAL_RANK when a launcher set it, else 0)."""
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def world_size(self) -> int:
        """Devices in the run (DeepSpeed counts one rank per accelerator)."""
        return jax.device_count()

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks, each with its own rows (the batch triad's count): data x expert, not the
        sequence axis, whose ranks share rows (DeepSpeed's `_get_data_parallel_world_size`)."""
        return row_size(self.plan.mesh)

    @property
    def seq_dp_world_size(self) -> int:
        """Ranks ZeRO shards over and gradients are averaged over: data-parallel x sequence-parallel."""
        return data_size(self.plan.mesh)

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks one row's tokens are split over (DeepSpeed-Ulysses; 1 without a sequence axis)."""
        return sequence_size(self.plan.mesh)

    @property
    def mp_world_size(self) -> int:
        """Ranks of one tensor-parallel group (1 without a tensor axis)."""
        return tensor_size(self.plan.mesh)

    @property
    def device(self) -> Any:
        return jax.local_devices()[0]

    # -- the config, as DeepSpeedEngine answers it -----------------------------------------------
    def fp16_enabled(self) -> bool:
        return bool(self.config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        return bool(self.config.bf16.enabled)

    def amp_enabled(self) -> bool:
        return False

    def zero_optimization(self) -> bool:
        return self.plan.stage > 0

    def zero_offload_optimizer(self) -> bool:
        return self.config.zero_optimization.offload_optimizer.device != "none"

    def zero_offload_param(self) -> bool:
        return self.config.zero_optimization.offload_param.device != "none"

    def zero_cpu_offload(self) -> bool:
        return self.config.zero_optimization.offload_optimizer.device == "cpu"

    def gradient_clipping(self) -> float:
        return float(self.config.gradient_clipping)

    def steps_per_print(self) -> int:
        return int(self.config.steps_per_print)

    def wall_clock_breakdown(self) -> bool:
        return bool(self.config.wall_clock_breakdown)

    def log_level(self) -> str | None:
        return self.config.log_level

    def dynamic_loss_scale(self) -> bool:
        return bool(self.plan.scaler.dynamic)

    def loss_scale(self) -> float:
        """The loss scale the next step uses (1.0 without fp16)."""
        return float(jax.device_get(self.state.scaler.scale))

    def communication_data_type(self) -> str | None:
        return self.config.communication_data_type

    def get_batch_info(self) -> tuple[int, int, int]:
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def __getattr__(self, name: str) -> Any:
        # only reached for attributes the engine does not have
        if name in DEEPSPEED_ONLY:
            raise AttributeError(f"engine.{name}: DeepSpeedEngine's {name} has no zerojax counterpart; "
                                 f"{DEEPSPEED_ONLY[name]}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
