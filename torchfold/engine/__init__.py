"""The engine: record deferred node calls, plan them, run every group as one batched call.

- :mod:`~torchfold.engine.node` and :mod:`~torchfold.engine.fold`: recording (``Fold.add``);
- :mod:`~torchfold.engine.planner`: a recorded fold planned into a picklable :class:`FoldPlan`;
- :mod:`~torchfold.engine.executor`: the executor of a plan, padded or not;
- :mod:`~torchfold.engine.static`: padding a plan into a fixed envelope of shapes (XLA, CUDA graphs,
  compiled steps), run by the same executor (``StaticLayout.run``);
- :mod:`~torchfold.engine.ops`: calling an op and checking what it returns, for the executor;
- :mod:`~torchfold.engine.autobatching`: plain per-sample PyTorch batched as it runs (:func:`autobatch`);
- :mod:`~torchfold.engine.eager`: the eager twin (:class:`EagerFold`), one call per node, for tests;
- :mod:`~torchfold.engine.draw`: pictures of a fold (needs the ``plot`` extra).

The engine imports nothing from :mod:`torchfold.train`, :mod:`torchfold.examples` or :mod:`torchfold.cli`.
"""

from torchfold._errors import FoldError
from torchfold.engine.autobatching import Pending, autobatch
from torchfold.engine.eager import EagerFold, EagerNode
from torchfold.engine.fold import Fold
from torchfold.engine.node import Node
from torchfold.engine.plan import FoldPlan
from torchfold.engine.static import StaticPlan, StaticShapes, StaticShapesOverflow, StaticShapesWarning

__all__ = [
    "EagerFold",
    "EagerNode",
    "Fold",
    "FoldError",
    "FoldPlan",
    "Node",
    "Pending",
    "StaticPlan",
    "StaticShapes",
    "StaticShapesOverflow",
    "StaticShapesWarning",
    "autobatch",
]
