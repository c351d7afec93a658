"""What a training run shows of its steps: a progress bar, or a log line every few steps.

On the main rank only, as tqdm and Lightning do it: a progress bar when stderr is a terminal,
and otherwise (a log file, a notebook, CI) a log line every ``log_every`` steps (default
:data:`DEFAULT_LOG_EVERY`) and at the last one; ``progress=False`` alone is quiet. A line gives
the step, the epoch, the global batch, the learning rate, and the loss and samples/s of the steps
since the line before (the loss: the mean over their samples, "mean over the last K steps").
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from types import TracebackType

from tqdm import tqdm

from torchfold.train.stats import StepStats

__all__ = ["DEFAULT_LOG_EVERY", "StepProgress", "progress_defaults"]

#: Steps between log lines where no progress bar is shown (Lightning's ``log_every_n_steps``).
DEFAULT_LOG_EVERY = 50


def progress_defaults(progress: bool | None, log_every: int | None, is_main: bool) -> tuple[bool, int]:
    """Whether to show a bar, and every how many steps to log a line, on this rank.

    ``None`` leaves the choice: a bar on a terminal, log lines elsewhere; ``progress=False``
    alone asks for a quiet run, as it did before log lines were the default.

    >>> progress_defaults(False, None, is_main=True), progress_defaults(True, 10, is_main=False)
    ((False, 0), (False, 10))
    """
    bar = (is_main and sys.stderr.isatty()) if progress is None else progress and is_main
    auto_lines = progress is None and not bar
    return bar, (DEFAULT_LOG_EVERY if auto_lines else 0) if log_every is None else log_every


class StepProgress:
    """The bar and the log lines of one :meth:`~torchfold.train.TraceTrainer.fit`, up to step ``end``.

    Every rank counts the steps' samples and losses; only the main rank writes lines (``log``)
    and shows a bar (``bar``).
    """

    def __init__(
        self, start: int, end: int, bar: bool, log_every: int, log: Callable[[str], None], is_main: bool
    ) -> None:
        self.end, self.log_every, self.log, self.is_main = end, log_every, log, is_main
        self._total, self._show = max(0, end - start), bar
        self._loss = self._samples = 0.0
        self._steps = 0  # steps since the last line
        self._since = time.perf_counter()

    def __enter__(self) -> StepProgress:
        """Show the bar (where asked) and start counting."""
        self.bar = tqdm(total=self._total, unit="step", disable=not self._show, dynamic_ncols=True)
        self._since = time.perf_counter()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.bar.close()

    def step(self, stats: StepStats, next_step: int) -> None:
        """Count a finished step, move the bar, and log a line where one is due."""
        self._loss += stats.loss * stats.batch_size if stats.num_minibatches else 0.0
        self._samples += stats.batch_size if stats.num_minibatches else 0
        self._steps += 1
        self.bar.update(1)
        self.bar.set_postfix(batch=stats.batch_size, loss=f"{stats.loss:.3f}", refresh=False)
        if self.log_every and (next_step % self.log_every == 0 or next_step == self.end):
            self._line(stats, next_step)

    def _line(self, stats: StepStats, next_step: int) -> None:
        """Log the steps since the last line (on the main rank), and start counting anew."""
        now = time.perf_counter()
        if self.is_main:
            loss = self._loss / self._samples if self._samples else math.nan
            rate = self._samples / max(now - self._since, 1e-9)
            steps = "the last step" if self._steps == 1 else f"the last {self._steps} steps"
            self.log(
                f"step {next_step}/{self.end} | epoch {stats.epoch} | batch {stats.batch_size} "
                f"({stats.num_minibatches} minibatches) | lr {stats.lr:.4g} | loss {loss:.4f} (mean over "
                f"{steps}) | {rate:.1f} samples/s"
            )
        self._loss = self._samples = 0.0
        self._steps = 0
        self._since = now
