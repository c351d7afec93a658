"""Static shapes: pad a compiled fold into a growing envelope so that XLA (and CUDA graphs) see repeating shapes.

:class:`StaticShapes` is the envelope a module keeps; :meth:`StaticShapes.fit` pads a
:class:`~torchfold.FoldPlan` into it and returns a :class:`StaticPlan`, whose outputs and
gradients equal the unpadded plan's. See ``docs/static-shapes.md`` for why an envelope.
"""

from torchfold.engine.static.shapes import (
    StaticInputs,
    StaticLayout,
    StaticPlan,
    StaticShapes,
    StaticShapesWarning,
)

__all__ = ["StaticInputs", "StaticLayout", "StaticPlan", "StaticShapes", "StaticShapesWarning"]
