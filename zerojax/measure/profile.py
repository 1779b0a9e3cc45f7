"""A per-module FLOPs profile of a compiled step, in the shape of DeepSpeed's flops profiler.

DeepSpeed's profiler hooks every `nn.Module` and counts what each one runs. A jitted step has no
modules left, only XLA instructions, but XLA keeps the Python call stack that made each one (the
module's StackFrames table). So every matmul of the compiled step is charged to the chain of calls
in the user's model that made it: the frames from the loss function inwards, with the engine's own
frames (the step, the per-layer gathers, `from_nnx`) and JAX's, optax's and Flax's transformation
frames left out, Flax's layers (`flax/nnx/nn`, `flax/linen` layers) kept. A module's node is its
function and the line it runs in the frame's file; the backward pass (a transpose of the forward)
is charged to the same frames as the forward it differentiates, and counted apart. FLOPs are
per execution of the step's program, loops counted trip-count times (`hlo.matmuls`).
"""
from __future__ import annotations

import dataclasses
import linecache
import os
from typing import Iterable

from zerojax.measure.hlo import Frame, Matmul

# Library code whose frames are machinery, not model structure.
_LIBRARIES = ("/jax/", "/jaxlib/", "/optax/", "/chex/", "/orbax/")
_FLAX_LAYERS = ("/flax/nnx/nn/", "/flax/linen/")
_FLAX_MACHINERY = {"module.py", "transforms.py", "partitioning.py", "spmd.py", "summary.py", "scan.py"}


def _engine(file: str) -> bool:
    """zerojax's own frames around the loss: everything but the models, `from_nnx` included."""
    f = file.replace(os.sep, "/")
    return "/zerojax/" in f and ("/zerojax/models/" not in f or f.endswith("/zerojax/models/nnx.py"))


def _machinery(file: str) -> bool:
    f = file.replace(os.sep, "/")
    if any(lib in f for lib in _LIBRARIES):
        return True
    if "/flax/" in f:
        return not any(layer in f for layer in _FLAX_LAYERS) or os.path.basename(f) in _FLAX_MACHINERY
    return False


def model_frames(stack: tuple[Frame, ...]) -> tuple[Frame, ...]:
    """The frames of a matmul's call stack that belong to the model: after the engine's last frame
    (the user's script and the step above it are not the model), without transformation machinery."""
    last = max((i for i, f in enumerate(stack) if _engine(f.file)), default=-1)
    return tuple(f for f in stack[last + 1:] if not _machinery(f.file))


def label(frame: Frame, snippet: int = 48) -> str:
    """`function (file:line)` and, when the source is at hand, the code it runs there (the call's
    own columns when XLA kept them, else the line)."""
    text = f"{frame.function.replace('.<locals>.', '.')} ({os.path.basename(frame.file)}:{frame.line})"
    line = linecache.getline(frame.file, frame.line)
    if frame.end_line == frame.line and frame.end_column > frame.column:
        line = line[frame.column:frame.end_column]
    code = " ".join(line.split())
    if code:
        text += f" `{code if len(code) <= snippet else code[:snippet - 3] + '...'}`"
    return text


@dataclasses.dataclass
class Node:
    """FLOPs charged to one chain of model frames (its path: labels from the outermost inwards)."""
    path: tuple[str, ...]
    forward: float = 0.0
    backward: float = 0.0

    @property
    def flops(self) -> float:
        return self.forward + self.backward


def call_tree(found: Iterable[Matmul]) -> tuple[dict[tuple[str, ...], Node], float]:
    """Every prefix of every model call chain with the FLOPs charged to it (a node counts its
    descendants), and the FLOPs of matmuls outside the model (the optimizer's, or any without a
    stack)."""
    nodes: dict[tuple[str, ...], Node] = {}
    outside = 0.0
    for m in found:
        frames = model_frames(m.stack)
        if not frames:
            outside += m.flops
            continue
        labels = tuple(label(f) for f in frames)
        for depth in range(1, len(labels) + 1):
            node = nodes.setdefault(labels[:depth], Node(labels[:depth]))
            if m.backward:
                node.backward += m.flops
            else:
                node.forward += m.flops
    return nodes, outside


def top_by_depth(nodes: dict[tuple[str, ...], Node], k: int, max_depth: int = -1) -> dict[int, list[Node]]:
    """The `k` nodes with the most FLOPs at each depth (1 = the outermost model frame), to
    `max_depth` (-1: every depth), as DeepSpeed's "top modules at different model depths"."""
    depths = sorted({len(p) for p in nodes})
    if max_depth >= 0:
        depths = [d for d in depths if d <= max_depth]
    return {d: sorted((n for p, n in nodes.items() if len(p) == d), key=lambda n: -n.flops)[:k] for d in depths}
