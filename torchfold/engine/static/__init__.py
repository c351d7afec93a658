"""Static shapes: pad a plan into a growing envelope so that XLA (and CUDA graphs) see repeating shapes.

:class:`StaticShapes` (:mod:`.shapes`) is the envelope a module keeps; :meth:`StaticShapes.cover`
pads a :class:`~torchfold.FoldPlan` into it and returns a :class:`StaticPlan` (:mod:`.padded`),
whose outputs and gradients equal the unpadded plan's. A plan is a :class:`StaticLayout`
(:mod:`.layout`: all that is constant per envelope version) and its batch's
:class:`StaticInputs`; ``plan.layout.run(nn, plan.inputs())`` is what ``plan.apply`` runs.
:func:`envelope_for` is the one rule of when a plan is padded, and into which envelope.
:mod:`.columns` reads a plan as padding sees it. See ``docs/design/envelope.md`` for
why an envelope.
"""

from torchfold.engine.static.layout import StaticLayout
from torchfold.engine.static.padded import StaticInputs, StaticPlan
from torchfold.engine.static.shapes import (
    StaticShapes,
    StaticShapesOverflow,
    StaticShapesWarning,
    envelope_for,
)

__all__ = [
    "StaticInputs",
    "StaticLayout",
    "StaticPlan",
    "StaticShapes",
    "StaticShapesOverflow",
    "StaticShapesWarning",
    "envelope_for",
]
