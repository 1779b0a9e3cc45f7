"""The HLO collective parser now lives in the library (`zerojax.core.hlo`); kept here for old imports."""
from zerojax.core.hlo import *  # noqa: F401,F403
from zerojax.core.hlo import Collective, DTYPE_BYTES, KINDS, collectives, summarize  # noqa: F401
