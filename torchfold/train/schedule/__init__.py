"""The batch-size schedule: how large each optimizer step's global batch is.

A batch-size trace (:class:`~torchfold.train.BatchSizeTrace`, read by
:mod:`~torchfold.train.schedule.trace` from a ``step,batchsize`` CSV file, a list or a schedule
such as ``"linear:32:256:60"``) gives every step its global batch; a resource-availability trace
(:mod:`~torchfold.train.schedule.availability`, devices available over time) converts to one.
:mod:`~torchfold.train.schedule.csvrows` reads both files' rows, and
:mod:`~torchfold.train.schedule.plot` draws a trace with the learning rate its LR rule gives.
"""
