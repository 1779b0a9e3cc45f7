"""Dtype policy: what the stored parameters, the master copy and the gradient accumulator hold."""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from zerojax.config import Config

_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


class Policy(NamedTuple):
    """`param` is what the forward pass reads; `master` is what the optimizer updates.

    With mixed precision (bf16/fp16) the two differ and the state keeps a separate fp32 master
    copy (the 4Ψ of ZeRO's K = 12); in fp32 training the parameters are their own master.
    """
    param: jnp.dtype
    master: jnp.dtype
    accum: jnp.dtype
    comm: jnp.dtype | None

    @property
    def mixed(self) -> bool:
        return self.param != self.master


def policy(config: Config) -> Policy:
    param = _DTYPES[config.compute_dtype]
    accum = _DTYPES[config.data_types.grad_accum_dtype] if config.data_types.grad_accum_dtype else param
    comm = _DTYPES[config.communication_data_type] if config.communication_data_type else None
    return Policy(param=jnp.dtype(param), master=jnp.dtype(jnp.float32), accum=jnp.dtype(accum),
                  comm=None if comm is None else jnp.dtype(comm))
