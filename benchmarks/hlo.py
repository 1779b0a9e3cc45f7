"""The HLO collective parser now lives in the library (`zerojax.hlo`, used by the comms logger)."""
from zerojax.hlo import DTYPE_BYTES, KINDS, Collective, collectives, summarize  # noqa: F401
