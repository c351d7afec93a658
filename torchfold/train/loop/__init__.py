"""The training loop: :class:`~torchfold.train.TraceTrainer` and what it keeps and reports.

:mod:`~torchfold.train.loop.trainer` runs the steps (through a step runner from
:mod:`torchfold.train.capture`); around it, :mod:`~torchfold.train.loop.checkpoint` and
:mod:`~torchfold.train.loop.trainer_state` save and resume a run, :mod:`~torchfold.train.loop.rng`
its random generators, :mod:`~torchfold.train.loop.preemption` stops it on SIGTERM,
:mod:`~torchfold.train.loop.stats`, :mod:`~torchfold.train.loop.deferral`,
:mod:`~torchfold.train.loop.progress` and :mod:`~torchfold.train.loop.tensorboard` read its losses
and report them, and :mod:`~torchfold.train.loop.threads` sets its CPU threads.
"""
