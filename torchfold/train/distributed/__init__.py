"""Where a run runs: its processes, its devices, and the elastic fit of its batch to them.

:mod:`~torchfold.train.distributed.world` joins the processes (``torchrun``, ``torch_xla``'s
replicas), answers which rank and device this process is (:class:`~torchfold.train.RunContext`)
and holds the collectives the rest call (the all-reduce, broadcasts, checks that every rank
agrees, with timeouts); :mod:`~torchfold.train.distributed.elastic` fits the global batch to the
devices present (:class:`~torchfold.train.ElasticConfig`); :mod:`~torchfold.train.distributed.devices`
is the one device policy (what a device needs: backend, dtype, static shapes, optimizer options,
synchronizing), and every private torch_xla call of the package is in
:mod:`~torchfold.train.distributed.xla_calls`.
"""
