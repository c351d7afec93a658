"""Plain per-sample PyTorch, batched as it runs: :func:`autobatch`.

A front end beside :class:`~torchfold.Fold`: instead of recording calls by name ahead of time,
the user's own per-sample function runs for every sample at once, each sample in a greenlet (a
coroutine switched by the library, so the user's code needs no ``yield``). A call of the model's
methods or submodules, or a torch function on a value they returned, does not run: it is
recorded as a pending call and returns a :class:`Pending` value at once, so one sample records
all the calls it can (a whole tree, for a recursive model) without waiting. A sample stops only
where it *reads* a value (``.item()``, ``bool(t)``, ``t.shape``, a tensor used as an index): it
waits for what it reads while the other samples go on recording.

When every sample has finished or waits, the scheduler runs the pending calls by readiness: a
call is ready once the calls it reads have run; ready calls of one op whose per-sample argument
shapes agree run as one batched call (shapes that differ make separate batches), and the op
whose ready calls are shallowest runs first, the order DyNet's agenda uses. Each call's result
is one row of the batched result (``result[i]``), gathered by index for the next call.

Two kinds of op, batched two ways:

* a **method or submodule of the model** (``model.cell(h, c)``, ``model.embedding(ids)``) is
  batched as a :class:`~torchfold.Fold` op is: the calls' tensor arguments are concatenated
  along dim 0 (each sample's tensor holds its rows there, usually one) and the op runs once, so
  it must treat rows independently, as every Fold op must;
* a **torch function or tensor method on a pending value** (``h + c``, ``torch.cat([a, b], -1)``,
  ``logits.argmax()``, ``F.cross_entropy(logits, y)``) is batched with ``torch.vmap``, which
  keeps its per-sample meaning whatever it does (reductions included); elementwise ones run on
  the stacked rows directly.

NOTE (why greenlets): a sample must be suspended in the middle of the user's plain code (deep in
its recursion) when it reads a value. Generators would need ``yield`` at every call in the user's
code; threads can suspend anywhere but a hand-off between two threads costs ~50x a greenlet
switch (``benchmarks/results/autobatch.md``). A greenlet switch is under a microsecond.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from torchfold._errors import FoldError, add_note
from torchfold.engine.readiness import Agenda

if TYPE_CHECKING:
    import greenlet

__all__ = ["Pending", "autobatch"]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_CONTAINERS = (tuple, list, dict)

# Tensor methods and functions that read a value or its metadata: a sample calling one waits for
# the value (the batched call that makes it) and gets the real answer.
_READS = frozenset(
    {
        "item",
        "tolist",
        "numpy",
        "size",
        "dim",
        "ndimension",
        "numel",
        "nelement",
        "stride",
        "is_contiguous",
        "is_floating_point",
        "is_complex",
        "element_size",
        "get_device",
        "data_ptr",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "__len__",
        "__iter__",
        "__format__",
        "__repr__",
        "__array__",
    }
)
_READ_ATTRIBUTES = frozenset({"shape", "dtype", "device", "ndim", "requires_grad", "is_cuda", "layout"})

# Elementwise functions: on rows stacked along a new dim 0, with every tensor argument of one
# shape and the rest Python numbers, each row's result is the function of that row's arguments.
_ELEMENTWISE = frozenset(
    {
        torch.add,
        torch.sub,
        torch.mul,
        torch.div,
        torch.neg,
        torch.tanh,
        torch.sigmoid,
        torch.relu,
        torch.exp,
        torch.log,
        torch.abs,
        torch.maximum,
        torch.minimum,
        _Tensor.add,
        _Tensor.sub,
        _Tensor.mul,
        _Tensor.div,
        _Tensor.neg,
        _Tensor.tanh,
        _Tensor.sigmoid,
        _Tensor.relu,
        _Tensor.exp,
        _Tensor.log,
        _Tensor.abs,
        _Tensor.__add__,
        _Tensor.__radd__,
        _Tensor.__sub__,
        _Tensor.__rsub__,
        _Tensor.__mul__,
        _Tensor.__rmul__,
        _Tensor.__truediv__,
        _Tensor.__rtruediv__,
        _Tensor.__neg__,
        torch.nn.functional.relu,
    }
)


# -- flattening arguments --------------------------------------------------------------------------


def _flatten(value: Any, leaves: list[Any]) -> Any:
    """``value``'s structure (tuples, lists and dicts), its other objects appended to ``leaves``."""
    cls = value.__class__
    if cls is tuple or cls is list:
        return (cls, tuple([_flatten(item, leaves) for item in value]))
    if cls is dict:
        return (dict, tuple(value), tuple([_flatten(item, leaves) for item in value.values()]))
    leaves.append(value)
    return None


def _unflatten(spec: Any, leaves: Iterable[Any]) -> Any:
    if spec.__class__ is int:  # a call's flat positional arguments (see _Scheduler.record)
        return tuple(leaves), {}
    return _build(spec, iter(leaves))


def _has_tensor(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a call's arguments hold a tensor or a pending value, at any depth."""
    for arg in args:
        cls = arg.__class__
        if cls is Pending or isinstance(arg, _Tensor):
            return True
        if cls is tuple or cls is list or cls is dict:
            break
    else:
        if not kwargs:
            return False
    leaves: list[Any] = []
    _flatten((tuple(args), kwargs), leaves)
    return any(leaf.__class__ is Pending or isinstance(leaf, _Tensor) for leaf in leaves)


def _build(spec: Any, leaves: Any) -> Any:
    if spec is None:
        return next(leaves)
    if spec[0] is dict:
        return dict(zip(spec[1], [_build(item, leaves) for item in spec[2]], strict=True))
    return spec[0]([_build(item, leaves) for item in spec[1]])


def _const_key(value: Any) -> Any:
    """How a non-tensor argument takes part in a call's batching key (calls batch only when these agree).

    Raises:
        TypeError: the value is unhashable (such a call runs alone).
    """
    if value.__class__ is float:
        return ("float", value.hex())  # -0.0 and 0.0 are two values; nan equals nan
    if isinstance(value, _Parameter):
        return ("parameter", id(value))
    hash(value)
    return (value.__class__, value)


# -- the values a sample sees ------------------------------------------------------------------


class _Op:
    """One op as the scheduler batches it: the callable, how its calls batch, what it returns."""

    __slots__ = ("fn", "name", "rows", "structure", "structure_key", "warned")

    def __init__(self, fn: Callable[..., Any], name: str, rows: bool, structure_key: Any) -> None:
        self.fn = fn
        self.name = name
        self.rows = rows  # a model method or submodule (rows along dim 0); else a torch function (vmap)
        # what it returns: None: not known yet; -1: a tensor; else (type, count) of a tuple, kept from run
        # to run (_STRUCTURES) so that a sample unpacking its result need not wait for it
        self.structure_key = structure_key
        self.structure: Any = _STRUCTURES.get(structure_key)
        self.warned = False


# What each op returned when it last ran, by (module class, method name) or torch function.
_STRUCTURES: dict[Any, Any] = {}


class _Call:
    """One pending call of one sample: its op, its arguments flattened, and once run, its result row."""

    __slots__ = (
        "dependents",
        "depth",
        "joined",
        "key",
        "kinds",
        "leaves",
        "op",
        "row",
        "sample",
        "spec",
        "values",
        "waiting",
    )

    def __init__(self, op: _Op, spec: Any, leaves: list[Any], sample: int) -> None:
        self.op = op
        self.spec = spec
        self.leaves = leaves
        self.sample = sample
        self.waiting = 0  # pending calls it reads that have not run
        self.depth = 0
        # NOTE: None until a call reads it, () once none is pending: no list per call (memory per node)
        self.dependents: list[_Call] | None = None
        self.values: list[_Tensor] | None = None  # each output's batched tensor, once run
        self.kinds: Sequence[Any] = ()  # each output's per-sample (shape, dtype, device), once run
        self.row = 0  # this call's row in them
        self.key: Any = None
        self.joined = False  # torch.cat(values) along dim 0: calls with any number of values batch together


class Pending:
    """A value that a call inside :func:`autobatch` will produce: use it as you would the tensor.

    Torch functions, tensor methods and operators on it are recorded and batched; reading it
    (``.item()``, ``bool(x)``, ``x.shape``, ``x.tolist()``) waits for its batched call and answers
    with the real value. ``autobatch`` returns real tensors in its place. It is not a
    ``torch.Tensor`` (``isinstance(x, torch.Tensor)`` is false).
    """

    __slots__ = ("_call", "_out")

    def __init__(self, call: _Call, out: int) -> None:
        self._call = call
        self._out = out  # which output of a call that returns a tuple; -1 for a single tensor

    def _value(self) -> _Tensor:
        call = self._call
        if call.values is None:
            _current().wait(call)
        assert call.values is not None
        if self._out < 0 and call.op.structure != -1:
            raise _used_whole(call)
        return call.values[(self._out if self._out > 0 else 0)][call.row]

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _READS:
            leaves: list[Any] = []
            spec = _flatten((tuple(args), kwargs), leaves)
            real_args, real_kwargs = _unflatten(spec, [_real(leaf) for leaf in leaves])
            return func(*real_args, **real_kwargs)
        if name.endswith("_") and not name.endswith("__"):
            raise FoldError(
                f"{name!r} changes a pending value in place inside autobatch; its row is shared with the batched "
                f"result of other samples: use the out-of-place form ({name.rstrip('_')!r})"
            )
        return _record(_function_op(func), args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in _READ_ATTRIBUTES:
            return getattr(self._value(), name)
        method = getattr(_Tensor, name)  # AttributeError as a tensor's
        if not callable(method):  # a property (x.T, x.mT): its getter is the op
            return _record(_function_op(method.__get__), (self,), {})
        return lambda *args, **kwargs: Pending.__torch_function__(method, (), (self, *args), kwargs)

    def __repr__(self) -> str:
        call = self._call
        state = "pending" if call.values is None else "computed"
        return f"Pending({call.op.name!r}, sample={call.sample}, {state})"

    # operators (a class that is not a tensor gets none from torch)
    def _binary(name: str) -> Callable[..., Any]:  # type: ignore[misc]
        method = getattr(_Tensor, name)

        def operator(self: Pending, other: Any) -> Any:
            return Pending.__torch_function__(method, (), (self, other))

        operator.__name__ = name
        return operator

    def _unary(name: str) -> Callable[..., Any]:  # type: ignore[misc]
        method = getattr(_Tensor, name)

        def operator(self: Pending) -> Any:
            return Pending.__torch_function__(method, (), (self,))

        operator.__name__ = name
        return operator

    __add__ = _binary("__add__")
    __radd__ = _binary("__radd__")
    __sub__ = _binary("__sub__")
    __rsub__ = _binary("__rsub__")
    __mul__ = _binary("__mul__")
    __rmul__ = _binary("__rmul__")
    __truediv__ = _binary("__truediv__")
    __rtruediv__ = _binary("__rtruediv__")
    __matmul__ = _binary("__matmul__")
    __rmatmul__ = _binary("__rmatmul__")
    __pow__ = _binary("__pow__")
    __rpow__ = _binary("__rpow__")
    __getitem__ = _binary("__getitem__")
    __lt__ = _binary("__lt__")
    __le__ = _binary("__le__")
    __gt__ = _binary("__gt__")
    __ge__ = _binary("__ge__")
    __neg__ = _unary("__neg__")
    __abs__ = _unary("__abs__")
    del _binary, _unary

    def __bool__(self) -> bool:
        return bool(self._value())

    def __int__(self) -> int:
        return int(self._value())

    def __float__(self) -> float:
        return float(self._value())

    def __index__(self) -> int:
        return self._value().__index__()

    def __len__(self) -> int:
        return len(self._value())

    def __iter__(self) -> Any:
        call = self._call
        if self._out < 0 and call.op.structure is None:
            _current().wait(call)
        if self._out < 0 and call.op.structure != -1:  # the whole result of an op that returned a tuple
            return iter(_outputs(call, call.op.structure))
        return iter(self._value())

    def item(self) -> Any:
        return self._value().item()

    def tolist(self) -> Any:
        return self._value().tolist()

    def size(self, dim: int | None = None) -> Any:
        value = self._value()
        return value.size() if dim is None else value.size(dim)

    def dim(self) -> int:
        return self._value().dim()


def _real(value: Any) -> Any:
    """A leaf with any pending value replaced by its tensor (waiting for it)."""
    if value.__class__ is Pending:
        call = value._call
        if value._out < 0 and call.op.structure not in (None, -1):  # a returned tuple, not unpacked
            return _real_outputs(call)
        return value._value()
    return value


def _real_all(leaves: list[Any]) -> list[Any]:
    """``leaves`` with every pending value replaced by its tensor, the rows of each batched result
    read together: one ``unbind`` (after one ``index_select`` unless all its rows are read), so the
    backward pass does work for the rows read, not a full-size zero tensor per row."""
    out = list(leaves)
    groups: dict[int, tuple[_Tensor, list[int], list[int]]] = {}
    for place, leaf in enumerate(leaves):
        if leaf.__class__ is not Pending:
            continue
        call = leaf._call
        if call.values is None or (leaf._out < 0 and call.op.structure != -1):
            out[place] = _real(leaf)
            continue
        source = call.values[(leaf._out if leaf._out > 0 else 0)]
        group = groups.get(id(source))
        if group is None:
            group = groups[id(source)] = (source, [], [])
        group[1].append(call.row)
        group[2].append(place)
    for source, rows, places in groups.values():
        if len(rows) == 1:
            parts: Sequence[_Tensor] = [source[rows[0]]]
        elif rows == list(range(source.shape[0])):
            parts = source.unbind(0)
        else:
            parts = source.index_select(0, torch.tensor(rows, device=source.device)).unbind(0)
        for place, part in zip(places, parts, strict=True):
            out[place] = part
    return out


def _run_joined(calls: list[_Call]) -> list[_Tensor]:
    """Many ``torch.cat(values)`` along dim 0 at once: one concatenation of every value read, split per call."""
    leaves = [leaf for call in calls for leaf in call.leaves]
    whole, lengths = _concatenated(leaves, stack=False)
    sizes = []
    start = 0
    for call in calls:
        end = start + len(call.leaves)
        sizes.append(sum(lengths[start:end]))
        start = end
    return list(torch.split(whole, sizes))


def _concatenated(leaves: list[Any], stack: bool) -> tuple[_Tensor, list[int]]:
    """The values of ``leaves`` concatenated along dim 0 (``stack``: each value one row, stacked
    along a new dim 0), and each one's length along it.

    A value is a row of an earlier batched result, or a tensor of the samples' own code. Rows read
    from one result are taken together (the whole result when that is all of it in order, a slice
    when they are consecutive, else one ``index_select``), the pieces concatenated once, and one
    more ``index_select`` puts them in the order of ``leaves`` if they are not: no tensor per value
    read from an earlier result, so the backward pass does no work per value either (``unbind``
    then ``cat`` would), and the work follows the rows read, not the size of the results.
    """
    groups: dict[int, tuple[_Tensor, list[int], int]] = {}  # id(source) -> (source, rows read, its piece)
    pieces: list[_Tensor] = []  # values along dim 0 (with stack each one row, else (values, length, ...))
    where: list[tuple[int, int]] = []  # each leaf's piece, and its place among the values of that piece
    loose: list[_Tensor] = []  # with stack, the tensors of the samples' own code
    for leaf in leaves:
        if leaf.__class__ is Pending:
            call = leaf._call
            source = call.values[(leaf._out if leaf._out > 0 else 0)]  # type: ignore[index]  # (ready: it has run)
            group = groups.get(id(source))
            if group is None:
                group = groups[id(source)] = (source, [], len(pieces))
                pieces.append(source)  # (the rows read, below)
            where.append((group[2], len(group[1])))
            group[1].append(call.row)
        elif stack:  # (stacked together below: one piece for all of them)
            where.append((-1, len(loose)))
            loose.append(leaf)
        else:
            where.append((len(pieces), 0))
            pieces.append(leaf.unsqueeze(0))
    if loose:
        where = [(len(pieces), place) if number < 0 else (number, place) for number, place in where]
        pieces.append(torch.stack(loose))
    for source, rows, number in groups.values():
        start = rows[0]
        if rows != list(range(start, start + len(rows))):
            pieces[number] = source.index_select(0, torch.tensor(rows, device=source.device))
        elif len(rows) != source.shape[0]:
            pieces[number] = source[start : start + len(rows)]
    starts = []
    start = 0
    if stack:  # each value one row
        for tensor in pieces:
            starts.append(start)
            start += tensor.shape[0]
        lengths = [1] * len(where)
        order = [starts[number] + place for number, place in where]
        whole = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    else:
        lengths = [pieces[number].shape[1] for number, _ in where]
        for tensor in pieces:
            starts.append(start)
            start += tensor.shape[0] * tensor.shape[1]
        order = []
        for (number, place), length in zip(where, lengths, strict=True):
            first = starts[number] + place * length
            order.extend(range(first, first + length))
        flat = [tensor.flatten(0, 1) for tensor in pieces]
        whole = flat[0] if len(flat) == 1 else torch.cat(flat)
    if order == list(range(whole.shape[0])):
        return whole, lengths
    return whole.index_select(0, torch.tensor(order, device=whole.device)), lengths


def _real_outputs(call: _Call) -> Any:
    kind, count = call.op.structure
    assert call.values is not None
    items = [call.values[number][call.row] for number in range(count)]
    return tuple(items) if kind is tuple else (items if kind is list else kind(items))


def _outputs(call: _Call, structure: tuple[Any, int]) -> Any:
    """The pending outputs of a call whose op returns a tuple (or list, or named tuple) of ``count``."""
    kind, count = structure
    if kind is tuple and count == 2:  # the common (h, c)
        return (Pending(call, 0), Pending(call, 1))
    items = [Pending(call, number) for number in range(count)]
    return tuple(items) if kind is tuple else (items if kind is list else kind(items))


def _used_whole(call: _Call) -> FoldError:
    return FoldError(
        f"autobatch: the result of {call.op.name!r} (sample {call.sample}) is a "
        f"{_describe(call.op.structure)} used as one tensor; unpack it first (a, b = ...)"
    )


def _function_op(func: Callable[..., Any]) -> _Op:
    scheduler = _current()
    op = scheduler.function_ops.get(func)
    if op is None:
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
        op = scheduler.function_ops[func] = _Op(func, f"torch {name}", rows=False, structure_key=func)
    return op


# -- the model as the samples see it ---------------------------------------------------------------


class _ModuleView:
    """A module whose method and submodule calls are recorded instead of run (see :func:`autobatch`)."""

    __slots__ = ("_module", "_scheduler")

    def __init__(self, module: torch.nn.Module, scheduler: _Scheduler) -> None:
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_scheduler", scheduler)

    def __getattr__(self, name: str) -> Any:
        module = self._module
        scheduler = self._scheduler
        known = scheduler.attributes.get((id(module), name))  # a submodule's view, or a method's recorder
        if known is not None:
            return known
        value = getattr(module, name)
        if isinstance(value, torch.nn.Module):
            known = _ModuleView(value, scheduler)
        else:
            func = getattr(value, "__func__", None)
            if func is None or getattr(value, "__self__", None) is not module:
                return value  # a parameter, a number, ...: as it is
            known = scheduler.method(self, module, name, func)
        scheduler.attributes[(id(module), name)] = known
        return known

    def __setattr__(self, name: str, value: Any) -> None:
        raise FoldError(
            f"setting {name!r} on the model inside autobatch: the samples run interleaved, so state kept on "
            "the model would mix them; keep per-sample state in local variables"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._scheduler.method(self, self._module, "__call__", None)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"autobatch view of {self._module!r}"


_ACTIVE: list[_Scheduler] = []


def _current() -> _Scheduler:
    if not _ACTIVE:
        raise FoldError(
            "a pending value of autobatch was used outside autobatch; use what autobatch returned"
        )
    return _ACTIVE[-1]


def _record(op: _Op, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    return _current().record(op, args, kwargs)


# -- the scheduler --------------------------------------------------------------------------------


class _Unbatchable(Exception):
    """A call the scheduler cannot put in a batch: it runs alone."""


class _Scheduler:
    """Runs the samples' greenlets and the pending calls, batched by readiness."""

    def __init__(self) -> None:
        # NOTE: greenlet loads on the first autobatch call, not with `import torchfold`.
        import greenlet

        self.getcurrent = greenlet.getcurrent
        self.new_greenlet = greenlet.greenlet
        self.main = greenlet.getcurrent()
        self.ready: Agenda[Any, _Call] = Agenda()  # ready calls by batching key
        self.callers: dict[tuple[int, str], Callable[..., Any]] = {}
        self.attributes: dict[
            tuple[int, str], Any
        ] = {}  # (module, name) -> a view or recorder (see _ModuleView)
        self.waiting: dict[_Call, list[greenlet.greenlet]] = {}
        self.runnable: list[tuple[greenlet.greenlet, int]] = []
        self.function_ops: dict[Any, _Op] = {}
        self.sample = -1  # the sample whose code runs now
        self.last_op = ""
        self.calls = 0  # calls recorded
        self.batches = 0  # batched calls made (a call that ran alone counts as one)
        self.alone = 0  # calls that ran alone

    # recording (inside a sample)

    def method(self, view: _ModuleView, module: torch.nn.Module, name: str, func: Any) -> Callable[..., Any]:
        """What ``view.name`` is: a function that records a call of the module's method ``name``."""
        caller = self.callers.get((id(module), name))
        if caller is not None:
            return caller
        label = f"{type(module).__name__}.{'forward' if name == '__call__' else name}"
        op = _Op(getattr(module, name), label, rows=True, structure_key=(type(module), name))
        record = self.record

        def call(*args: Any, **kwargs: Any) -> Any:
            if func is not None and not _has_tensor(args, kwargs):
                return func(view, *args, **kwargs)  # no tensor in: the sample's own Python code, run inline
            return record(op, args, kwargs)

        self.callers[(id(module), name)] = call
        return call

    def record(self, op: _Op, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        joined = (
            op.fn is torch.cat
            and len(args) > 0
            and args[0].__class__ in (list, tuple)
            and args[1:] in ((), (0,))
            and kwargs in ({}, {"dim": 0})
        )
        if joined:  # torch.cat(values) along dim 0 (its default): the values are its leaves
            args, kwargs = (list(args[0]),), {}
        flat = not kwargs
        if flat:
            for arg in args:
                if arg.__class__ in _CONTAINERS:
                    flat = False
                    break
        if flat:
            leaves: list[Any] = list(args)
            spec: Any = len(leaves)  # flat positional arguments: no structure to keep
        else:
            leaves = []
            spec = _flatten((tuple(args), kwargs), leaves)
        call = _Call(op, spec, leaves, self.sample)
        call.joined = joined
        self.calls += 1
        self.last_op = op.name
        depth = 0
        for leaf in leaves:
            if leaf.__class__ is Pending:
                source = leaf._call
                if source.values is None:
                    call.waiting += 1
                    if source.dependents is None:
                        source.dependents = [call]
                    else:
                        source.dependents.append(call)
                if source.depth >= depth:
                    depth = source.depth + 1
        call.depth = depth
        if not call.waiting:
            self.make_ready(call)
        structure = op.structure
        if structure is None or structure == -1:  # (unknown: unpacking it waits, see Pending.__iter__)
            return Pending(call, -1)
        return _outputs(call, structure)

    def make_ready(self, call: _Call) -> None:
        try:
            if call.joined:
                self.make_ready_joined(call)
                return
            parts: list[Any] = [call.op]
            for leaf in call.leaves:
                if leaf.__class__ is Pending:
                    if leaf._out < 0 and leaf._call.op.structure != -1:
                        raise _used_whole(leaf._call)
                    parts.append(leaf._call.kinds[(leaf._out if leaf._out > 0 else 0)])
                elif leaf.__class__ is _Tensor or (
                    isinstance(leaf, _Tensor) and not isinstance(leaf, _Parameter)
                ):
                    # (the exact-class test first: Parameter's isinstance check runs Python code)
                    parts.append((leaf.shape, leaf.dtype, leaf.device))
                else:
                    parts.append(_const_key(leaf))
            parts.append(call.spec)
            key: Any = tuple(parts)
            call.key = key
            self.ready.add(
                key, call, call.depth
            )  # (hashing the key raises TypeError before it changes anything)
            return
        except TypeError:
            key = call  # an argument it cannot compare (an unhashable object): the call runs alone
            if not call.op.warned:
                call.op.warned = True
                kinds = sorted({type(leaf).__name__ for leaf in call.leaves if not _hashable(leaf)})
                warnings.warn(
                    f"autobatch: calls of {call.op.name!r} with an argument of type {', '.join(kinds)} cannot be "
                    "batched (it cannot be compared across samples), so they run one at a time; pass tensors, "
                    "numbers or other hashable values instead",
                    stacklevel=4,
                )
        call.key = key
        self.ready.add(key, call, call.depth)

    def make_ready_joined(self, call: _Call) -> None:
        """A ``torch.cat(values)`` along dim 0: it batches with every other such call whose values
        share their trailing shape, dtypes and device, whatever their number."""
        kinds: set[Any] = set()  # each value's per-sample (shape, dtype, device): few distinct ones
        for leaf in call.leaves:
            if leaf.__class__ is Pending:
                source, out = leaf._call, leaf._out
                if out < 0:
                    if source.op.structure != -1:
                        raise _used_whole(source)
                    out = 0
                kinds.add(source.kinds[out])
            elif isinstance(leaf, _Tensor):
                kinds.add((leaf.shape, leaf.dtype, leaf.device))
            else:  # not a tensor: alone, failing as eager does (torch.cat's TypeError)
                call.key = call
                self.ready.add(call, call, call.depth)
                return
        kinds = {(shape[1:], dtype, device, len(shape)) for shape, dtype, device in kinds}  # rows may differ
        # (mixed kinds, or 0-dim values: the call runs alone, and fails as eager does)
        joinable = len(kinds) == 1 and next(iter(kinds))[3] > 0
        key = (call.op, "joined", frozenset(kinds)) if joinable else call
        call.key = key
        self.ready.add(key, call, call.depth)

    def wait(self, call: _Call) -> None:
        """Return once ``call`` has run: the current sample waits (the others go on), or, outside
        the samples, the scheduler runs until it has."""
        if call.values is not None:
            return
        current = self.getcurrent()
        if current is self.main:
            while call.values is None:
                self.step()
            return
        self.waiting.setdefault(call, []).append(current)
        self.main.switch()

    # running

    def run(self, fn: Callable[..., Any], model: _ModuleView, samples: Sequence[Any]) -> list[Any]:
        results: list[Any] = [None] * len(samples)

        def body(index: int, sample: Any) -> None:
            results[index] = fn(model, sample)

        self.runnable = [
            (self.new_greenlet(lambda i=index, s=sample: body(i, s), parent=self.main), index)
            for index, sample in enumerate(samples)
        ]
        self.runnable.reverse()
        while self.runnable or self.ready:
            while self.runnable:
                task, index = self.runnable.pop()
                self.sample = index
                try:
                    task.switch()
                except Exception as error:
                    add_note(
                        error,
                        f"in sample {index} of autobatch (its last op called: {self.last_op or 'none'})",
                    )
                    raise
                self.sample = -1
            if self.ready:
                self.step()
        if self.waiting:  # cannot happen: a waited call is ready or waits on one that is
            raise FoldError("autobatch: samples wait for calls that can never run")
        leaves: list[Any] = []
        spec = _flatten(results, leaves)
        return _unflatten(spec, _real_all(leaves))  # type: ignore[no-any-return,unused-ignore]

    def step(self) -> None:
        """Run the ready calls of one op and shapes: those whose shallowest call is shallowest."""
        wanted = self.wanted() if self.waiting else None
        key, calls = self.ready.pop(wanted or None)
        self.execute(calls, alone=key.__class__ is _Call)
        for call in calls:
            for dependent in call.dependents or ():
                dependent.waiting -= 1
                if not dependent.waiting:
                    self.make_ready(dependent)
            call.dependents = None
            waiting = self.waiting.pop(call, None)
            if waiting:
                self.runnable.extend((task, call.sample) for task in waiting)

    def wanted(self) -> set[Any]:
        """The keys of the ready calls that the samples waiting to read a value need first.

        NOTE: while some samples wait, only what they read (and the calls it depends on) runs;
        the other ready calls wait for more of their kind: a sample that has finished its parse
        adds its classifier call, which then runs with every other sample's, not alone.
        """
        keys: set[Any] = set()
        seen: set[int] = set()
        todo = list(self.waiting)
        while todo:
            call = todo.pop()
            if id(call) in seen:
                continue
            seen.add(id(call))
            if call.key is not None:  # ready: nothing it reads is pending
                keys.add(call.key)
                continue
            todo.extend(
                leaf._call for leaf in call.leaves if leaf.__class__ is Pending and leaf._call.values is None
            )
        return keys

    def execute(self, calls: list[_Call], alone: bool) -> None:
        op = calls[0].op
        self.batches += 1
        if (len(calls) == 1 or calls[0].joined) and not alone:  # its own arguments, no stacking
            outs = _run_joined(calls) if calls[0].joined else [self.run_alone(op, calls[0])]
            for call, one in zip(calls, outs, strict=True):
                self.store(op, [call], one, batched=False)
            return
        if not alone:
            try:
                out = _run_batched(op, calls)
            except FoldError:
                raise
            except Exception as error:
                batched_error = error
            else:
                self.store(op, calls, out, batched=True)
                return
            outs = [self.run_alone(op, call) for call in calls]  # a sample's own error raises here
            if not op.warned:
                op.warned = True
                warnings.warn(
                    f"autobatch: {op.name!r} failed batched ({type(batched_error).__name__}: {batched_error}) but "
                    "ran on each sample alone, so its calls run one at a time; make it batchable (a model method "
                    "must treat rows of dim 0 independently; a torch function must work under torch.vmap)",
                    stacklevel=3,
                )
            self.batches += len(calls) - 1
        else:
            outs = [self.run_alone(op, call) for call in calls]
        self.alone += len(calls)
        for call, one in zip(calls, outs, strict=True):
            self.store(op, [call], one, batched=False)

    def run_alone(self, op: _Op, call: _Call) -> Any:
        args, kwargs = _unflatten(call.spec, _real_all(call.leaves))
        try:
            return op.fn(*args, **kwargs)
        except Exception as error:
            add_note(error, f"in sample {call.sample} of autobatch, calling {op.name!r}")
            raise

    def store(self, op: _Op, calls: list[_Call], out: Any, batched: bool) -> None:
        if isinstance(out, _Tensor):
            structure: Any = -1
            outputs: Sequence[Any] = (out,)
        elif isinstance(out, tuple | list):
            structure = (type(out), len(out))
            outputs = out
        else:
            raise FoldError(
                f"autobatch: {op.name!r} returned a {type(out).__name__} (in sample {calls[0].sample}); an op on "
                "pending values must return a tensor or a tuple of tensors: read values with .item() or .tolist()"
            )
        if op.structure is None:
            op.structure = _STRUCTURES[op.structure_key] = structure
        elif op.structure != structure:
            raise FoldError(
                f"autobatch: {op.name!r} returned {_describe(structure)} in sample {calls[0].sample} but "
                f"{_describe(op.structure)} before; an op must return the same structure on every call"
            )
        values = []
        for number, value in enumerate(outputs):
            if not isinstance(value, _Tensor):
                raise FoldError(
                    f"autobatch: {op.name!r} returned a {type(value).__name__} as output {number}; ops must "
                    "return tensors"
                )
            values.append(value if batched else value.unsqueeze(0))
        kinds = [(value.shape[1:], value.dtype, value.device) for value in values]
        for row, call in enumerate(calls):
            call.values = values
            call.kinds = kinds
            call.row = row
            call.leaves = []  # what it read is no longer needed


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _describe(structure: Any) -> str:
    return "a tensor" if structure == -1 else f"a {structure[0].__name__} of {structure[1]}"


def _gather(calls: list[_Call], positions: list[int]) -> list[_Tensor]:
    """The arguments at leaf ``positions`` of ``calls``, each stacked along a new dim 0 (one row per call).

    Positions whose values have one kind (shape, dtype, device) are gathered together, in one
    :func:`_concatenated` (each earlier result read once), then cut into positions. Rows of one
    result passed to one position in order need no copy at all. So the work follows the rows read
    and the number of results read, not the number of calls or positions.
    """
    count = len(calls)
    first = calls[0]
    gathered: dict[int, _Tensor] = {}
    by_kind: dict[Any, list[int]] = {}
    for position in positions:
        leaf = first.leaves[position]
        whole = _passed_through(calls, position, count)
        if whole is not None:
            gathered[position] = whole
            continue
        if leaf.__class__ is Pending:
            kind = leaf._call.kinds[(leaf._out if leaf._out > 0 else 0)]
        else:
            kind = (leaf.shape, leaf.dtype, leaf.device)
        by_kind.setdefault(kind, []).append(position)
    for together in by_kind.values():
        for position, tensor in zip(together, _gather_kind(calls, together, count), strict=True):
            gathered[position] = tensor
    return [gathered[position] for position in positions]


def _passed_through(calls: list[_Call], position: int, count: int) -> _Tensor | None:
    """The earlier batched result whose rows are, all of them in order, the values at ``position``; or None."""
    leaf = calls[0].leaves[position]
    if leaf.__class__ is not Pending or leaf._call.row != 0:
        return None
    out = leaf._out
    values = leaf._call.values
    assert values is not None  # (ready: it has run)
    source = values[(out if out > 0 else 0)]
    if source.shape[0] != count:
        return None
    for row, call in enumerate(calls):
        leaf = call.leaves[position]
        if (
            leaf.__class__ is not Pending
            or leaf._call.row != row
            or leaf._call.values is not values
            or leaf._out != out
        ):
            return None
    return source


def _gather_kind(calls: list[_Call], positions: list[int], count: int) -> list[_Tensor]:
    leaves = [call.leaves[position] for position in positions for call in calls]
    whole, _ = _concatenated(leaves, stack=True)
    # (narrow, not split: an op may change one of its arguments in place, which autograd refuses on
    # the views of one split)
    return [whole.narrow(0, number * count, count) for number in range(len(positions))]


def _run_batched(op: _Op, calls: list[_Call]) -> Any:
    first = calls[0]
    count = len(calls)
    positions = [
        number
        for number, leaf in enumerate(first.leaves)
        if leaf.__class__ is Pending
        or leaf.__class__ is _Tensor
        or (isinstance(leaf, _Tensor) and not isinstance(leaf, _Parameter))
    ]
    stacked = _gather(calls, positions)
    leaves = list(first.leaves)

    def with_args(tensors: Sequence[_Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        for position, tensor in zip(positions, tensors, strict=True):
            leaves[position] = tensor
        args, kwargs = _unflatten(first.spec, leaves)
        return args, kwargs

    if op.rows and all(tensor.dim() >= 2 for tensor in stacked):
        # a model method: rows of each sample's tensors concatenated along dim 0
        args, kwargs = with_args([tensor.flatten(0, 1) for tensor in stacked])
        out = op.fn(*args, **kwargs)
        outputs = (out,) if isinstance(out, _Tensor) else out
        if not isinstance(outputs, tuple | list) or not all(
            isinstance(value, _Tensor) and value.dim() and value.shape[0] % count == 0 for value in outputs
        ):
            raise _Unbatchable(f"{op.name!r} did not return rows for each call")
        unflat = [value.unflatten(0, (count, -1)) for value in outputs]
        return unflat[0] if isinstance(out, _Tensor) else type(out)(unflat)
    if (
        not op.rows
        and op.fn in _ELEMENTWISE
        and len({tensor.shape for tensor in stacked}) == 1
        and all(
            isinstance(leaf, int | float)
            for number, leaf in enumerate(first.leaves)
            if number not in positions
        )
    ):
        args, kwargs = with_args(stacked)
        return op.fn(*args, **kwargs)

    def one(*tensors: _Tensor) -> Any:
        args, kwargs = with_args(tensors)
        return op.fn(*args, **kwargs)

    return torch.vmap(one)(*stacked)


def autobatch(
    fn: Callable[[Any, Any], Any],
    samples: Iterable[Any],
    model: torch.nn.Module,
    *,
    stats: dict[str, int] | None = None,
) -> list[Any]:
    """Run plain per-sample PyTorch code ``fn(model, sample)`` for every sample, batched automatically.

    ``fn`` is written for one sample, as you would run it eagerly, with Python recursion, loops
    and branches, including branches on values it computed (``if logits.argmax().item() == 0:``).
    Here it receives a view of ``model`` on which method and submodule calls are recorded and
    batched across samples, and within a sample across calls that do not depend on each other;
    torch functions on their results are batched too (see the module's documentation). Results
    and gradients equal running ``fn(model, sample)`` on each sample alone.

    Args:
        fn: the per-sample function, called as ``fn(model_view, sample)``. Methods and
            submodules of the model it calls with tensors must treat rows (dim 0) independently,
            as a :class:`~torchfold.Fold` op must; a method called without tensor arguments (the
            recursion itself, given a tree) runs as plain Python.
        samples: the samples, any Python objects.
        model: the module whose methods and submodules the samples call.
        stats: a dict to fill with what the run did: ``calls`` (calls recorded), ``batches``
            (op calls made, a call run alone counting as one) and ``alone`` (calls run alone).

    Returns:
        ``fn``'s return value for each sample, in order, with real tensors (rows of the batched
        results, so gradients flow back through them).

    Raises:
        TypeError: ``fn`` is not callable or ``model`` is not a module.
        Exception: an exception raised in a sample's code or in an op it called, of its own type,
            with a note naming the sample's index and the op.

    Example:
        >>> import torch, torchfold
        >>> class Model(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.cell = torch.nn.Linear(2, 2)
        >>> def chain(model, length):  # plain per-sample code
        ...     h = torch.ones(1, 2)
        ...     for _ in range(length):
        ...         h = torch.tanh(model.cell(h))
        ...     return h.sum()
        >>> model = Model()
        >>> batched = torchfold.autobatch(chain, [1, 3, 2], model)
        >>> eager = [chain(model, n) for n in [1, 3, 2]]
        >>> all(torch.allclose(b, e) for b, e in zip(batched, eager))
        True
    """
    if not callable(fn):
        raise TypeError(f"autobatch(fn=...) must be callable, got {fn!r}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"autobatch(model=...) must be a torch.nn.Module, got {type(model).__name__}; pass the module whose "
            "methods the per-sample function calls"
        )
    if stats is not None and not isinstance(stats, dict):
        raise TypeError(f"autobatch(stats=...) must be a dict to fill, got {type(stats).__name__}")
    samples = list(samples)
    scheduler = _Scheduler()
    _ACTIVE.append(scheduler)
    # NOTE: a run makes a few Python objects per call (pending values, calls, their argument lists),
    # all alive until the run ends; the cyclic collector's passes over them cost up to twice the
    # run's own time (benchmarks/results/autobatch.md), and nothing in them is garbage before the
    # run ends. So it is paused for the run, and the run's objects are freed when it returns.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return scheduler.run(fn, _ModuleView(model, scheduler), samples)
    finally:
        if collecting:
            gc.enable()
        _ACTIVE.pop()
        if stats is not None:
            stats.update(calls=scheduler.calls, batches=scheduler.batches, alone=scheduler.alone)
