"""The data side of a step: which samples each rank builds into which plans.

:mod:`~torchfold.train.data.sampler` splits each step's global batch (from the schedule) over the
ranks and into minibatches (:class:`~torchfold.train.TraceBatchSampler`);
:mod:`~torchfold.train.data.loader` builds those minibatches into plans, in worker processes if
asked (:class:`~torchfold.train.StepLoader`); :mod:`~torchfold.train.data.prefetch` builds them
in a background thread; :mod:`~torchfold.train.data.envelope` measures a dataset to fit the
static shapes that XLA's programs need (:func:`~torchfold.train.fit_static_shapes`).
"""
