"""The optimizer side of a step: accumulation, the one all-reduce, the learning rate, precision.

:mod:`~torchfold.train.optim.optimizer` wraps any ``torch.optim`` optimizer
(:class:`~torchfold.train.AccumulatingOptimizer`): it weights and accumulates a step's minibatch
gradients, all-reduces them once per step, clips them and scales the learning rate to the step's
batch by the rule of :mod:`~torchfold.train.optim.lr` (linear, square root, AdaScale);
:mod:`~torchfold.train.optim.precision` adds bf16 and fp16 autocast and loss scaling.
"""
