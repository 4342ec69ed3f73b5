"""The step time that engine tests run under where they want one shaped like hardware's.

Not a test file: the engine tests load it by path (`runpy.run_path`), since tests are not a
package (pytest runs with --import-mode=importlib).
"""

from __future__ import annotations

import numpy as np
from kvfrag.sim.timing import TableTime

#: A hardware-shaped step time (sim/timing.py): non-linear in the batch, LM head per sampled
#: position, decode KV read apart from the prefill chunks' attention.
TABLE = TableTime(
    source="test",
    body=0.03 + 1e-3 * np.sqrt(np.arange(161.0)),
    head=2e-4 * np.arange(161.0),
    overhead_s=1e-3,
    decode_fixed_s=2e-3,
    per_kv_token_s=1e-4,
    prefill_fixed_s=1e-3,
    prefill_pair_s=1e-6,
    prefill_token_s=3e-5,
)
