"""Memory and step-time estimates before anything runs (`zerojax estimate`, docs/estimate.md).

One module per question:

* `deepspeed`: DeepSpeed's own model-state estimators, transcribed (same integer results).
* `shapes`: the model as abstract parameters (the embedded models, a Hugging Face `config.json`, or
  DeepSpeed's two parameter counts).
* `memory`: plan-exact bytes - the real `zerojax.plan` of each ZeRO stage and offload choice on an
  abstract mesh of the asked size, counted by its own `memory_report` - and the recommendation.
* `timing`: per-device FLOPs, HBM and collective bytes over a device's peak numbers.
* `tensor`, `axes`: the tensor-parallel rows and the expert / sequence rows (their own formulas).
* `command`: what `zerojax estimate` was asked and the text it prints.

The names below are the package's public surface (`zerojax.tools.estimate.plan_exact`, ...).
"""
from zerojax.tools.estimate.command import (Request, build_request, choose_model, estimate_all, parse_bytes,
                                            parse_tensor, report)
from zerojax.tools.estimate.deepspeed import deepspeed_zero2, deepspeed_zero3
from zerojax.tools.estimate.memory import (CHOICES, GIB, OFFLOADS, Choice, MemoryEstimate, abstract_mesh,
                                           deepspeed_estimate, plan_exact, recommend, variant)
from zerojax.tools.estimate.shapes import Arch, ModelShape, counts_model, embedded_model, hf_model
from zerojax.tools.estimate.timing import (PRESETS, DeviceSpec, StepTime, analytic_costs, compiled_costs,
                                              scale_comm, step_time, zero_comm_bytes)
from zerojax.tools.estimate.tensor import (TensorRow, recommend_tensor, shard_model, tensor_row, tensor_rows,
                                           tensor_sizes)
from zerojax.tools.estimate.axes import AxisRow, expert_rows, sequence_rows

__all__ = [
    "Arch", "AxisRow", "CHOICES", "Choice", "DeviceSpec", "GIB", "MemoryEstimate", "ModelShape", "OFFLOADS",
    "PRESETS", "Request", "StepTime", "TensorRow", "abstract_mesh", "analytic_costs", "build_request",
    "choose_model", "compiled_costs", "counts_model", "deepspeed_estimate", "deepspeed_zero2", "deepspeed_zero3",
    "embedded_model", "estimate_all", "expert_rows", "hf_model", "parse_bytes", "parse_tensor", "plan_exact",
    "recommend", "recommend_tensor", "report", "scale_comm", "sequence_rows", "shard_model", "step_time",
    "tensor_row", "tensor_rows", "tensor_sizes", "variant", "zero_comm_bytes",
]
