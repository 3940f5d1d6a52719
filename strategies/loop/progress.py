"""Progress on long runs: a tqdm bar on an interactive terminal, a compact log line otherwise.

The bar draws on the terminal itself (it redraws one line in place, which a log record cannot);
the line is a log record at info level, so ``-q`` silences it.

When progress is reported must be the same on every rank (reporting follows a collective that
combines the ranks' step measurements), so it depends only on the step count, never on whether
this rank has a terminal.
"""

from __future__ import annotations

import math
import sys
import time

from tqdm import tqdm

from kanscale import log

logger = log.get(__name__)


class Progress:
    def __init__(
        self, total: int, enabled: bool, interactive: bool | None = None, log_every: int = 0, start: int = 0
    ) -> None:
        self.total, self.start_step = total, start
        self.every = log_every or max(1, math.ceil(total / 20))
        self.enabled = enabled
        interactive = sys.stderr.isatty() if interactive is None else interactive
        self.bar = (
            tqdm(total=total, initial=start, unit="step", dynamic_ncols=True) if enabled and interactive else None
        )
        self.start = time.perf_counter()

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def update(self, step: int, loss: float, samples_per_s: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{loss:.3e}", samples_s=f"{samples_per_s:,.0f}")
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / max(1, step - self.start_step) * (self.total - step)
        logger.info(
            f"[kanscale] step {step}/{self.total}  loss {loss:.4e}  {samples_per_s:,.0f} samples/s  "
            f"elapsed {elapsed:.1f}s  eta {eta:.1f}s"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
