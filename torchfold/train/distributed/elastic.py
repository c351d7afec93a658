"""Elastic configuration: how a global batch maps onto the devices that are actually present.

Given a global batch and the most samples one device can hold, :class:`ElasticConfig` decides how
many accumulation steps each optimizer step takes and how many samples each device processes in
each of them, for whatever number of devices this run found.

The split: with ``D`` devices, ``k = ceil(global / (D * max))`` accumulation steps give ``k * D``
slots; slot ``(step a, rank r)`` is number ``a * D + r``, and the first ``global % (k * D)`` slots
get one sample more than the others. So the device batches add up to the global batch exactly,
differ by at most one, and never exceed the maximum. When the global batch is smaller than the
number of devices, some slots are empty (0 samples): that device takes part in the step's
all-reduce with zero gradients (see :class:`~torchfold.train.AccumulatingOptimizer`).
"""

from __future__ import annotations

import math
import warnings

from torchfold._deprecation import RenamedAttribute
from torchfold._validate import check_int
from torchfold.train.distributed.world import check_rank, world

__all__ = ["ElasticConfig"]


class ElasticConfig:
    """Accumulation steps and per-device batch sizes for a global batch on the devices present.

    Args:
        global_batch_size: samples per optimizer step, over all devices and accumulation steps.
        max_device_batch_size: most samples one device processes at once (what fits in memory).
        num_replicas: number of devices (replicas, one process each); default: this run's
            (:func:`~torchfold.train.world`).
        rank: this process's rank in ``[0, num_replicas)``; default: this run's
            (:func:`~torchfold.train.world`).
        max_accumulation_steps: the most accumulation steps a step may take (default: no limit);
            a global batch that needs more on these devices is refused.
        world_size: deprecated keyword for ``num_replicas`` (emits a ``FutureWarning``).

    Raises:
        ValueError: a size < 1, a rank outside the world, or a global batch the devices cannot
            hold within ``max_accumulation_steps``.

    >>> c = ElasticConfig(256, 64, num_replicas=2)
    >>> c.accumulation_steps, c.device_batch_size, c.num_replicas
    (2, 64, 2)
    >>> c = ElasticConfig(100, 20, num_replicas=3)  # 2 accumulation steps x 3 devices = 6 slots
    >>> [c.batch_sizes(rank) for rank in range(3)]
    [[17, 17], [17, 16], [17, 16]]
    """

    def __init__(
        self,
        global_batch_size: int,
        max_device_batch_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        max_accumulation_steps: int | None = None,
        *,
        world_size: int | None = None,
    ) -> None:
        if world_size is not None:
            if num_replicas is not None:
                raise TypeError(
                    f"give num_replicas={num_replicas}, not also the deprecated world_size={world_size} (its old name)"
                )
            warnings.warn(
                "ElasticConfig(world_size=) is deprecated; use num_replicas= (the devices sharing each step)",
                FutureWarning,
                stacklevel=2,
            )
            num_replicas = world_size
        self.global_batch_size = check_int("global_batch_size", global_batch_size)
        self.max_device_batch_size = check_int("max_device_batch_size", max_device_batch_size)
        if num_replicas is None or rank is None:
            found = world(warn_unconnected=True)
            self.source = found.source if num_replicas is None else "argument"
            num_replicas = found.size if num_replicas is None else num_replicas
            rank = found.rank if rank is None else rank
        else:
            self.source = "argument"
        check_int("num_replicas", num_replicas)
        check_rank(rank, num_replicas)
        self.num_replicas = num_replicas
        self.rank = rank
        self.accumulation_steps = math.ceil(global_batch_size / (num_replicas * max_device_batch_size))
        self.max_accumulation_steps = max_accumulation_steps
        if max_accumulation_steps is not None:
            check_int("max_accumulation_steps", max_accumulation_steps)
            if self.accumulation_steps > max_accumulation_steps:
                most = num_replicas * max_device_batch_size * max_accumulation_steps
                raise ValueError(
                    f"a global batch of {global_batch_size} needs {self.accumulation_steps} accumulation steps on "
                    f"{num_replicas} device(s) of at most {max_device_batch_size} samples, more than "
                    f"max_accumulation_steps={max_accumulation_steps} (they hold {most}); add devices, or raise "
                    "the per-device maximum or max_accumulation_steps"
                )
        slots = self.accumulation_steps * num_replicas
        self._base, self._extra = divmod(global_batch_size, slots)
        # The largest device batch in the split; every device batch is this or one less.
        self.device_batch_size = self._base + (1 if self._extra else 0)

    num_devices = RenamedAttribute("num_replicas", "the devices sharing each step")

    @property
    def is_main(self) -> bool:
        """True for rank 0, the process that logs and writes checkpoints."""
        return self.rank == 0

    @property
    def is_even(self) -> bool:
        """True when every device processes the same number of samples in every accumulation step."""
        return self._extra == 0

    def batch_size(self, accumulation_step: int, rank: int | None = None) -> int:
        """Samples that ``rank`` (default: this process) processes in one accumulation step.

        Args:
            accumulation_step: index in ``[0, accumulation_steps)``.
            rank: a rank in ``[0, num_replicas)``; default this process's rank.
        """
        rank = self.rank if rank is None else rank
        if not 0 <= accumulation_step < self.accumulation_steps:
            raise ValueError(
                f"accumulation_step must be in [0, {self.accumulation_steps - 1}], got {accumulation_step}"
            )
        if not 0 <= rank < self.num_replicas:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {self.num_replicas - 1}]"
            )
        slot = accumulation_step * self.num_replicas + rank
        return self._base + (1 if slot < self._extra else 0)

    def batch_sizes(self, rank: int | None = None) -> list[int]:
        """The device batches of ``rank`` (default: this process) for each accumulation step, in order."""
        return [self.batch_size(a, rank) for a in range(self.accumulation_steps)]

    def minibatch_sizes(self) -> list[int]:
        """The step's non-empty minibatches over all devices, in slot order (slot ``a * D + r``).

        Minibatch ``j`` of the list is device ``j % D``'s, in accumulation step ``j // D``: the
        dealing rule of :class:`~torchfold.train.TraceBatchSampler`, which cuts each step's samples into
        these sizes. Empty slots (a global batch smaller than the device count) come last and are
        left out.

        >>> ElasticConfig(100, 20, num_replicas=3).minibatch_sizes()
        [17, 17, 17, 17, 16, 16]
        >>> ElasticConfig(2, 64, num_replicas=4).minibatch_sizes()  # devices 2 and 3 idle
        [1, 1]
        """
        sizes = [
            self._base + (1 if slot < self._extra else 0)
            for slot in range(self.accumulation_steps * self.num_replicas)
        ]
        return [size for size in sizes if size]

    def with_global_batch_size(self, global_batch_size: int) -> ElasticConfig:
        """The same devices and maximum for another global batch (a trace changes it every step)."""
        return ElasticConfig(
            global_batch_size,
            self.max_device_batch_size,
            self.num_replicas,
            self.rank,
            max_accumulation_steps=self.max_accumulation_steps,
        )

    def __repr__(self) -> str:
        return (
            f"ElasticConfig(global_batch_size={self.global_batch_size}, max_device_batch_size="
            f"{self.max_device_batch_size}, num_replicas={self.num_replicas}, rank={self.rank}, "
            f"accumulation_steps={self.accumulation_steps}, device_batch_size={self.device_batch_size})"
        )
