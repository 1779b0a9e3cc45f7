"""The HLO collective parser now lives in the library (`zerojax.hlo`); kept here for old imports."""
from zerojax.hlo import *  # noqa: F401,F403
from zerojax.hlo import Collective, DTYPE_BYTES, KINDS, collectives, summarize  # noqa: F401
