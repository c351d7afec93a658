"""A plan padded into an envelope (:class:`StaticPlan`), its inputs (:class:`StaticInputs`), and how they run.

:meth:`StaticLayout.run <torchfold.engine.static.layout.StaticLayout.run>` (:func:`run`) is the
executor of every plan (:func:`~torchfold.engine.executor.run_calls`) with its arguments read as
slices of the inputs' tensors: a pure function of a module and those tensors, so that compiled
steps can trace it once per layout. :meth:`StaticPlan.apply` runs it on the plan's own inputs.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np
import torch

from torchfold._errors import FoldError
from torchfold.engine.devices import is_xla, on_host
from torchfold.engine.executor import run_calls
from torchfold.engine.ir import check_pad_rows, check_portable_op, check_request_number, portable_tensors
from torchfold.engine.ops import dtypes_disagree, gathered_dtype, tuple_used_whole
from torchfold.engine.resolve import device_for

if TYPE_CHECKING:
    from torchfold.engine.static.layout import Slot, StaticGather, StaticLayout
    from torchfold.engine.static.shapes import StaticShapes

__all__ = ["StaticInputs", "StaticPlan", "run"]

_Tensor = torch.Tensor
_NUMPY_DEFAULT = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}

# Exact (unpadded) outputs on XLA: per module, the distinct output sizes returned so far. Each is a
# new shape for whatever the caller computes on them (a loss, its backward): a new program.
_EXACT_SIZES: weakref.WeakKeyDictionary[Any, set[tuple[int, ...]]] = weakref.WeakKeyDictionary()
#: distinct exact output sizes on XLA after which ``apply`` warns (once per module) that the loss recompiles
EXACT_SIZES_WARN = 4


class StaticInputs(NamedTuple):
    """What one batch gives a :class:`StaticLayout`'s executor: fixed-shape tensors, one set per plan.

    ``ints`` (int64) holds every gather's index and every int column, ``floats`` (the default
    float dtype) every float column, end to end; their lengths are the layout's
    (``num_ints``, ``num_floats``). ``given`` holds the tensors given to ``add``: per position
    that reads them, padded to its capacity (a shape the layout fixes), then per request of
    tensors, as given: a request whose tensors vary in rows varies this shape, and so the graph.
    """

    ints: _Tensor
    floats: _Tensor
    given: tuple[_Tensor, ...]


class StaticPlan:
    """A plan padded into a :class:`StaticShapes` envelope: every plan of one envelope version
    runs the same tensor operations on the same shapes, so XLA compiles it once.

    Made by :meth:`StaticShapes.cover` (or ``Fold(shapes=...).plan(...)``); it pickles like a
    :class:`~torchfold.FoldPlan`. It is a :class:`StaticLayout` (:attr:`layout`, shared by
    every plan of the envelope version) and this batch's data: all index arrays and int
    columns packed into one int64 array (:attr:`ints`), float columns into one float64 array
    (:attr:`floats`), and the tensors given to ``add``; :meth:`inputs` makes them tensors.
    """

    def __init__(
        self,
        layout: StaticLayout,
        ints: np.ndarray,
        floats: np.ndarray,
        given: tuple[_Tensor, ...],
        *,
        sizes: list[int],
        real_calls: int,
        num_nodes: int,
        device: torch.device | None,
        volatile: bool,
    ) -> None:
        self.layout = layout
        self.ints = ints
        self.floats = floats
        self.given = given
        #: calls (nodes) each request asks for, and how many rows ``apply(padded=True)`` returns for it
        self.sizes = sizes
        self.capacities = [
            size if capacity is None else capacity
            for capacity, size in zip(layout.capacities, sizes, strict=True)
        ]
        self.real_calls = real_calls
        self.num_nodes = num_nodes
        self.device = device
        self.volatile = volatile
        # (the envelope, its state before the fit that made this plan grew it): put back if this plan fails
        self._undo: tuple[weakref.ref[StaticShapes], tuple[int, int, dict[str, Any]]] | None = None

    @property
    def slots(self) -> list[Slot]:
        """The layout's batched calls, in the order they run."""
        return self.layout.slots

    @property
    def padded_calls(self) -> int:
        """Calls run, padding included (``real_calls`` are the plan's own)."""
        return self.layout.total_calls

    def inputs(self, device: torch.device | str | None = None) -> StaticInputs:
        """This batch's :class:`StaticInputs` on ``device`` (default: the plan's, else the CPU).

        Fresh tensors at every call: what :meth:`StaticLayout.run` reads. One transfer for the
        ints, one for the floats, one per given tensor.
        """
        device = device_for(None, self.device if device is None else device)
        ints = torch.from_numpy(self.ints).to(device, copy=True)
        floats = torch.from_numpy(self.floats).to(device=device, dtype=torch.get_default_dtype(), copy=True)
        return StaticInputs(ints, floats, tuple(tensor.to(device) for tensor in self.given))

    def pad(self, request: int, values: Any, fill: float = 0) -> _Tensor:
        """``values`` (one per node of request ``request``) as a tensor padded to its capacity with ``fill``.

        With ``apply(model, padded=True)``, pad per-node targets and weights so that the padded
        rows weigh nothing: ``(losses * plan.pad(0, weights)).sum()``, or cross-entropy with
        ``ignore_index`` and ``plan.pad(0, labels, fill=-100)``. Give host values (a list, a
        numpy array or a CPU tensor) and move the result to the device: its shape is the
        capacity's, so on XLA it never makes a new graph.

        >>> import torch, torchfold
        >>> f = torchfold.Fold(shapes=torchfold.StaticShapes(min_rows=4))
        >>> plan = f.plan([[f.add(torch.neg, 1), f.add(torch.neg, 2)]])
        >>> plan.pad(0, [0.5, 0.5])
        tensor([0.5000, 0.5000, 0.0000, 0.0000])
        """
        check_request_number(request, len(self.sizes))
        size, capacity = self.sizes[request], self.capacities[request]
        if isinstance(values, _Tensor) and not on_host(values.device):
            tensor = values  # already on a device: padded there (on XLA, sizes that vary then compile anew)
            check_pad_rows(request, tuple(tensor.shape), size)
            out = tensor.new_full((capacity, *tensor.shape[1:]), fill)
            out[:size] = tensor
            return out
        # On the host, in numpy: only the padded tensor is made, so its shape never varies.
        array = values.numpy() if isinstance(values, _Tensor) else np.asarray(values)
        if array.dtype == np.float64 and not isinstance(values, np.ndarray | _Tensor):
            array = array.astype(
                _NUMPY_DEFAULT.get(torch.get_default_dtype(), np.float32)
            )  # Python floats: torch's default dtype
        check_pad_rows(request, array.shape, size)
        padded = np.full((capacity, *array.shape[1:]), fill, dtype=array.dtype)
        padded[:size] = array
        return torch.from_numpy(padded)

    def unpad(self, outputs: Sequence[_Tensor]) -> list[_Tensor]:
        """Padded outputs (of :meth:`StaticLayout.run`) cut to this plan's requested rows."""
        cut = []
        for output, size, capacity in zip(outputs, self.sizes, self.capacities, strict=True):
            rows = output.shape[0] // capacity if capacity else 1
            cut.append(output[: size * rows])
        return cut

    def apply(self, nn: torch.nn.Module | object, *, padded: bool = False) -> list[_Tensor]:
        """Run the padded plan on ``nn``; one tensor per request (padded to its capacity if ``padded``).

        The same as ``plan.layout.run(nn, plan.inputs(device))`` (then :meth:`unpad`, unless
        ``padded``), ``device`` being the plan's, else the module's.

        Raises:
            FoldError: unknown op, or an op returning something other than rows per call.
        """
        device = device_for(nn, self.device)
        try:
            if self.volatile:
                with torch.no_grad():
                    outputs = self.layout.run(nn, self.inputs(device))
            else:
                outputs = self.layout.run(nn, self.inputs(device))
        except BaseException:
            # A fold that fails (an unknown op, say) leaves the envelope as it was: had its fit's
            # growth stayed, every later plan would run its slots too, and fail the same way.
            shapes = self._undo[0]() if self._undo is not None else None
            if shapes is not None and self._undo is not None:
                shapes.undo_fit(self._undo[1])
            self._undo = None
            raise
        self._undo = None  # it ran: what it grew is the envelope's for good
        if padded:
            return outputs
        if is_xla(device):
            _note_exact(nn, self.sizes)
        return self.unpad(outputs)

    def __getstate__(self) -> dict[str, Any]:
        """What pickles: refused, like a :class:`~torchfold.FoldPlan`'s, where a copy would cut gradients off.

        Raises:
            FoldError: an op is a bound method, or a tensor given to ``add`` requires grad.
        """
        for slot in self.layout.slots:
            check_portable_op(slot.op, slot.name, slot.depth)
        given = tuple(
            portable_tensors(tensor, where)
            for tensor, where in zip(self.given, self.layout.given, strict=True)
        )
        return {**self.__dict__, "given": given, "_undo": None}  # (the undo is the fitting process's)

    def __len__(self) -> int:
        return self.num_nodes

    def __repr__(self) -> str:
        return (
            f"StaticPlan({len(self.slots)} slots, {self.num_nodes} nodes in {self.real_calls} calls padded to "
            f"{self.padded_calls}, requests {self.sizes} of {self.capacities})"
        )


def _note_exact(nn: object, sizes: list[int]) -> None:
    """Note exact outputs of ``sizes`` returned on XLA for ``nn``; warn once when they keep changing."""
    try:
        seen = _EXACT_SIZES.setdefault(nn, set())
    except TypeError:  # not weakly referenceable: nothing to count on
        return
    if len(seen) >= EXACT_SIZES_WARN:
        return
    seen.add(tuple(sizes))
    if len(seen) == EXACT_SIZES_WARN:
        warnings.warn(
            f"apply on an XLA device returned exact outputs of {EXACT_SIZES_WARN} different sizes for "
            f"{type(nn).__name__}: the fold runs padded, but a loss (and its backward) on exact rows compiles a new "
            "program for every new size; use padded outputs and targets: plan = Fold(shapes=StaticShapes.of(model))"
            ".plan([nodes]); outputs = plan.apply(model, padded=True); weight the padded rows 0 with "
            "plan.pad(0, weights), or plan.pad(0, labels, fill=-100) for cross_entropy's ignore_index",
            UserWarning,
            stacklevel=_outside_torchfold(),
        )


def _outside_torchfold() -> int:
    """The ``stacklevel`` (for a ``warnings.warn`` in the caller) of the first frame outside torchfold."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("torchfold."):
        frame, level = frame.f_back, level + 1
    return level


def run(layout: StaticLayout, nn: object, inputs: StaticInputs, *, padded: bool = True) -> list[_Tensor]:
    """:meth:`StaticLayout.run` (see there): the executor (:func:`~torchfold.engine.executor.run_calls`)
    on the layout's slots, their arguments read from one plan's inputs."""
    if not padded:
        raise ValueError(
            "StaticLayout.run(padded=False): a layout does not know a batch's sizes; run it padded and cut the "
            "outputs with plan.unpad(outputs), or call plan.apply(nn)"
        )
    ints, floats, given = inputs
    if (
        ints.shape != (layout.num_ints,)
        or floats.shape != (layout.num_floats,)
        or len(given) != len(layout.given)
    ):
        raise ValueError(
            f"StaticLayout.run: inputs of {tuple(ints.shape)} ints, {tuple(floats.shape)} floats and {len(given)} "
            f"given tensors, but this layout takes ({layout.num_ints},), ({layout.num_floats},) and {len(layout.given)}; "
            "pass the inputs of a plan of this layout (plan.inputs(), where plan.layout.key is this layout's key)"
        )
    return run_calls(nn, layout.slots, _SlotResults(layout, inputs), len(layout.requests), padded=True)


class _SlotResults:
    """A static layout's results (:class:`~torchfold.engine.executor.Results`): the outputs of the
    slots run so far, by (slot, output or None), and the running concatenations; arguments are
    slices of the inputs' packed tensors. Tensor operations only: the executor is captured through it."""

    def __init__(self, layout: StaticLayout, inputs: StaticInputs) -> None:
        self.slots = layout.slots
        self.requests = layout.requests
        self.ints, self.floats, self.given = inputs
        self.tensors: dict[tuple[int, int | None], _Tensor] = {}
        # per set of streams: its running concatenation, and how many pieces it holds
        self.memories: dict[frozenset[Any], tuple[_Tensor, int]] = {}

    def arguments(self, slot: Slot) -> list[Any]:
        args: list[Any] = [None] * slot.arity
        for gather, (start, end) in zip(slot.gathers, slot.gather_spans, strict=True):
            taken, rows = self._take(gather, self.ints[start:end])
            if len(gather.positions) == 1:
                args[gather.positions[0]] = taken
            else:
                for where, part in zip(gather.positions, taken.split(gather.items * rows), strict=True):
                    args[where] = part
        for position, kind, where in slot.fixed:
            args[position] = self._fixed(kind, where)
        return args

    def store(self, number: int, slot: Slot, out: Any, outputs: Sequence[_Tensor]) -> None:
        if isinstance(out, _Tensor):
            self.tensors[(number, None)] = out
        else:
            for output, value in enumerate(outputs):
                self.tensors[(number, output)] = value

    def request(self, number: int) -> _Tensor:
        request = self.requests[number]
        where = request.where
        if request.gather is not None:
            return self._take(request.gather, self.ints[where[0] : where[1]])[0]
        return self._fixed(request.kind, where)

    def _fixed(self, kind: str, where: Any) -> _Tensor:
        """An argument or request that needs no gather: a span of the ints or floats, or a given tensor."""
        if kind == "ints":
            return self.ints[where[0] : where[1]]
        if kind == "floats":
            return self.floats[where[0] : where[1]]
        return self.given[where]

    def _take(self, gather: StaticGather, index: _Tensor) -> tuple[_Tensor, int]:
        """The rows of a gather: its pieces concatenated (a running concatenation extended, for a gather
        reading every earlier level), then one ``index_select``."""
        results, slots = self.tensors, self.slots
        memory = None if gather.streams is None else self.memories.get(gather.streams)
        have = 0 if memory is None else memory[1]
        tensors = []
        for piece in gather.pieces[have:]:
            tensor = results.get((piece.slot, piece.output))
            if (
                tensor is None
            ):  # a result used whole that was a tuple (what is split is checked by check_outputs)
                slot = slots[piece.slot]
                count = slot.num_outputs or len([key for key in results if key[0] == piece.slot])
                raise tuple_used_whole(
                    f"a node of op {slot.name!r} at depth {slot.depth}", slot.name, slot.depth, count
                )
            tensors.append(tensor)
        # What the envelope joins over all batches must agree, though each batch alone may read only
        # some of it: rows per call, row shape and dtype of every piece.
        first = gather.pieces[0]
        reference = memory[0] if memory is not None else tensors[0]
        rows = reference.shape[0] // (
            first.calls if memory is None else sum(p.calls for p in gather.pieces[:have])
        )
        mixed = False  # rows of different float precision (autocast): promoted, as in a plain plan
        for piece, tensor in zip(gather.pieces[have:], tensors, strict=True):
            if tensor.shape[0] != piece.calls * rows or tensor.shape[1:] != reference.shape[1:]:
                raise FoldError(
                    f"static shapes: an argument position reads the outputs of op {slots[first.slot].name!r} "
                    f"({rows} rows of {tuple(reference.shape[1:])} {reference.dtype} per call) and, in this or an earlier "
                    f"batch, of op {slots[piece.slot].name!r} ({tensor.shape[0] / piece.calls:g} rows of "
                    f"{tuple(tensor.shape[1:])} {tensor.dtype} per call); one envelope pads them together, so they must "
                    "agree: give ops of different outputs different names, or use a StaticShapes per kind of graph"
                )
            if tensor.dtype != reference.dtype:
                if gathered_dtype([reference.dtype, tensor.dtype]) is None:
                    raise FoldError(
                        dtypes_disagree(
                            "static shapes: an argument position (one envelope pads its rows together, over "
                            "this and earlier batches)",
                            f"op {slots[first.slot].name!r}",
                            reference.dtype,
                            f"op {slots[piece.slot].name!r}",
                            tensor.dtype,
                        )
                    )
                mixed = True
        if memory is not None:
            tensors.insert(0, memory[0])
        if mixed:
            dtype = cast(torch.dtype, gathered_dtype([tensor.dtype for tensor in tensors]))  # (checked above)
            tensors = [tensor.to(dtype) for tensor in tensors]
        source = tensors[0] if len(tensors) == 1 else torch.cat(tensors, 0)
        if gather.streams is not None:
            self.memories[gather.streams] = (source, len(gather.pieces))
        if rows != 1:
            index = (index.unsqueeze(1) * rows + torch.arange(rows, device=index.device)).reshape(-1)
        return source.index_select(0, index), rows
