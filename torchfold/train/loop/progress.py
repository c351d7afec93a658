"""What a training run shows of its steps: a progress bar, or a log line every few steps.

On the main rank only, as tqdm and Lightning do it: a progress bar when stderr is a terminal,
and otherwise (a log file, a notebook, CI) a log line every ``log_every`` steps (default
:data:`DEFAULT_LOG_EVERY`) and at the last one; ``progress=False`` alone is quiet. A line gives
the step, the epoch, the global batch, the learning rate, and the loss and samples/s of the steps
since the line before (the loss: the mean over their samples, "mean over the last K steps");
an evaluation, its metrics.

Lines go to the ``torchfold`` logger (:data:`LOGGER`) at INFO, or to a ``log`` callable instead;
where the program has not configured :mod:`logging`, the logger shows them on stderr (through
tqdm, so that a bar stays whole). Beside the lines, each metrics callback (``on_metrics``, e.g. a
:class:`~torchfold.train.loop.tensorboard.TensorBoardWriter`) gets the same numbers by name:
``train/loss``, ``train/lr``, ``train/batch_size``, ``train/samples_per_s`` at every line, and
``eval/<name>`` for each metric of an evaluation.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType

from tqdm import tqdm

from torchfold.train.loop.stats import StepStats

__all__ = [
    "DEFAULT_LOG_EVERY",
    "LOGGER",
    "MetricsCallback",
    "StepProgress",
    "default_log",
    "metrics_line",
    "progress_defaults",
]

#: Steps between log lines where no progress bar is shown (Lightning's ``log_every_n_steps``).
DEFAULT_LOG_EVERY = 50

#: The logger of torchfold's training runs.
LOGGER = logging.getLogger("torchfold")

#: ``callback(step, metrics)``: the step the metrics are of (the number of steps run: a line's
#: ``next_step``), and the metrics by name (``train/loss``, ``eval/accuracy``, ...)
MetricsCallback = Callable[[int, Mapping[str, float]], None]


class _TqdmHandler(logging.Handler):
    """Writes records to stderr through ``tqdm.write``, which keeps a progress bar whole."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # logging's rule: a handler never raises
            self.handleError(record)


def default_log() -> Callable[[str], None]:
    """Where a run's lines go without ``log=``: :data:`LOGGER` at INFO.

    Where neither the logger nor the root logger has a handler (the program left :mod:`logging`
    alone), the logger gets one that shows INFO lines on stderr, as a training run is expected to.
    """
    if not LOGGER.handlers and not logging.getLogger().handlers:
        handler = _TqdmHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        LOGGER.addHandler(handler)
        if LOGGER.level == logging.NOTSET:
            LOGGER.setLevel(logging.INFO)
    return LOGGER.info


def metrics_line(step: int, metrics: Mapping[str, float]) -> str:
    """An evaluation's log line.

    >>> metrics_line(40, {"loss": 0.51234, "accuracy": 0.8})
    'eval at step 40 | loss 0.5123 | accuracy 0.8'
    """
    return " | ".join([f"eval at step {step}", *(f"{name} {value:.4g}" for name, value in metrics.items())])


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
        self,
        start: int,
        end: int,
        bar: bool,
        log_every: int,
        log: Callable[[str], None],
        is_main: bool,
        on_metrics: Sequence[MetricsCallback] = (),
    ) -> None:
        self.end, self.log_every, self.log, self.is_main = end, log_every, log, is_main
        self.on_metrics = tuple(on_metrics)
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
            self._report(
                next_step,
                {
                    "train/loss": loss,
                    "train/lr": stats.lr,
                    "train/batch_size": float(stats.batch_size),
                    "train/samples_per_s": rate,
                },
            )
        self._loss = self._samples = 0.0
        self._steps = 0
        self._since = now

    def evaluated(self, next_step: int, metrics: Mapping[str, float]) -> None:
        """Log an evaluation's metrics after ``next_step`` steps (on the main rank), and report them."""
        if self.is_main:
            self.log(metrics_line(next_step, metrics))
            self._report(next_step, {f"eval/{name}": value for name, value in metrics.items()})

    def _report(self, next_step: int, metrics: Mapping[str, float]) -> None:
        for callback in self.on_metrics:
            callback(next_step, metrics)
