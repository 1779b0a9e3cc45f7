"""The HLO collective parser now lives in the library (`zerojax.measure.hlo`); kept here for old imports."""
from zerojax.measure.hlo import *  # noqa: F401,F403
from zerojax.measure.hlo import Collective, DTYPE_BYTES, KINDS, collectives, summarize  # noqa: F401
