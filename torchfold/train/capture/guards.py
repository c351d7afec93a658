"""What the Python side of a captured step reads, checked before every replay: :class:`StepGuard`.

A replayed program sees only its inputs: the tensors it was given by role (parameters, buffers,
optimizer state, the batch, the runner's own scalars). Everything else the step's Python code
read while it was captured is frozen into the program: a number in the loss (``0.01 * penalty``),
a module's ``training`` flag, a tensor kept as a plain attribute. Replaying after such a value
changed would silently compute with the old one. A guard, in the spirit of TorchDynamo's, reads
the places such values live in before every replay, for a few microseconds, and the runner
keys its programs on what it reads: a change selects (or captures) the program of the new value,
and a value that keeps changing is refused, with a warning naming it and where it is read.

Where a guard looks (once per capture, then the same places at every replay):

* every submodule of the model: its ``training`` flag and its attributes holding numbers,
  strings, ``None`` or tuples, lists and dicts of them (``self.alpha = 0.5``); a tensor kept as
  a plain attribute (not a parameter or buffer) on the model's device is an input of the
  program instead (:meth:`StepGuard.tensors`), one elsewhere is guarded by its version counter
  (an in-place change);
* the globals of those number kinds that the model's own methods name;
* the loss: which function it is, its defaults, its closure's values, the globals it names, and
  the attributes of the object it is bound to or of a callable object (one level down), the
  same kinds as above (a ``functools.partial``: its arguments too);
* whether autocast is on for the model's device, and its dtype (``precision="bf16"``).

A value read from anywhere else (a global of another module that a helper reads, an object
two levels down) is not seen here: the runner's periodic check (a new capture compared with the
program every ``verify_every`` replays, and at every checkpoint) finds it, with an error.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch

from torchfold.train.distributed.devices import on_host

__all__ = ["MAX_VALUES", "StepGuard", "frozen_value"]

#: distinct values of what a guard reads, per program key, before a value that keeps changing is refused
MAX_VALUES = 4

#: the attributes every module has (its parameters, hooks...): not values a step reads as numbers
_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__) - {"training"}
_UNSEEN = object()  # a value of a kind the guard does not follow
_MISSING = ("missing",)  # an attribute that is not there (yet, or any longer)
_MAX_ITEMS = 64  # a longer list or dict is not a setting


def frozen_value(value: Any) -> Hashable:
    """A comparable snapshot of a plain value (number, string, ``None``, or tuples, lists and
    dicts of them), that tells apart what eager code can tell apart (``1``, ``1.0`` and ``True``;
    ``0.0`` and ``-0.0``); ``_UNSEEN`` for anything else.

    >>> frozen_value(0.0) == frozen_value(-0.0), frozen_value(1) == frozen_value(True)
    (False, False)
    >>> frozen_value([1, 2.5]) == frozen_value((1, 2.5))
    False
    """
    kind = type(value)
    if kind is float:
        return ("f", value.hex())
    if kind in (int, bool, str, bytes, type(None)):
        return (kind.__name__, value)
    if kind is complex:
        return ("c", value.real.hex(), value.imag.hex())
    if kind in (tuple, list) and len(value) <= _MAX_ITEMS:
        items = tuple(frozen_value(item) for item in value)
        return _UNSEEN if _UNSEEN in items else (kind.__name__, items)
    if kind is dict and len(value) <= _MAX_ITEMS:
        pairs = tuple((frozen_value(k), frozen_value(v)) for k, v in value.items())
        return _UNSEEN if any(_UNSEEN in pair for pair in pairs) else ("dict", pairs)
    return _UNSEEN


class StepGuard:
    """The values a step's Python code may read besides its inputs, for ``model`` and ``loss``.

    >>> model = torch.nn.Linear(2, 1)
    >>> model.alpha = 0.5
    >>> guard = StepGuard(model, lambda m, outputs, targets: outputs[0].sum() * m.alpha)
    >>> before = guard.values()
    >>> model.alpha = 2.0
    >>> guard.values() == before, guard.changed(before)
    (False, ['the attribute alpha of the model (0.5 -> 2.0)'])
    """

    def __init__(self, model: torch.nn.Module, loss: Callable[..., Any]) -> None:
        self.model, self.loss = model, loss
        self._slots: list[tuple[str, Callable[[], Any]]] = []
        self._tensors: list[tuple[str, Callable[[], Any]]] = []
        self._seen: dict[Hashable, list[tuple[Hashable, ...]]] = {}  # per program key: the values admitted
        self.refresh()

    def refresh(self) -> None:
        """Find the places to read anew (a capture calls it: the model may have new attributes)."""
        places = _Places(self.model)
        for name, module in self.model.named_modules():
            places.attributes(
                module.__dict__, f"of the model's {name}" if name else "of the model", module=True
            )
        for kind in {type(module) for module in self.model.modules()}:
            if kind.__module__.startswith("torch."):
                continue
            for function in _functions_of(kind):
                places.globals_named(function, f"named by {kind.__name__}.{function.__name__}")
        places.function(self.loss, "the loss", depth=0)
        if places.device is not None:  # autocast changes the ops a capture records
            places.slots[f"autocast on {places.device.type}"] = functools.partial(
                _autocast, places.device.type
            )
        self._slots = list(places.slots.items())
        self._tensors = list(places.tensors.values())

    def values(self) -> tuple[Hashable, ...]:
        """What each place holds now (compare two with ``==``)."""
        return tuple(read() for _, read in self._slots)

    def changed(self, before: tuple[Hashable, ...], now: tuple[Hashable, ...] | None = None) -> list[str]:
        """The places whose value differs between ``before`` (an earlier :meth:`values`) and
        ``now`` (default: the values now), named, with both values."""
        now = self.values() if now is None else now
        found = []
        for (label, _), then, value in zip(self._slots, before, now, strict=False):
            if then != value:
                found.append(f"{label} ({_shown(then)} -> {_shown(value)})")
        return found

    def admit(self, key: Hashable, values: tuple[Hashable, ...]) -> str | None:
        """Whether a program keyed ``key`` may be had for ``values`` (an earlier :meth:`values`):
        None if so (a program per value, up to :data:`MAX_VALUES`), else why not, naming what
        keeps changing and the fix.

        >>> model = torch.nn.Linear(1, 1)
        >>> guard = StepGuard(model, lambda m, o, t: o[0].sum())
        >>> for model.alpha in range(6):
        ...     guard.refresh()
        ...     why = guard.admit("layout", guard.values())
        >>> print(why)  # doctest: +ELLIPSIS
        the attribute alpha of the model (3 -> 5) took more than 4 values...
        """
        known = self._seen.setdefault(key, [])
        if values in known:
            return None
        if len(known) >= MAX_VALUES:
            changed = self.changed(known[-1], values)
            return (
                f"{'; '.join(changed) or 'a value the step reads'} took more than {MAX_VALUES} values, and each "
                "value read outside a tensor is a new program to compile; keep such a value in a tensor (a buffer: "
                "module.register_buffer(name, torch.tensor(value))) and change it in place to replay it"
            )
        known.append(values)
        return None

    def tensors(self) -> list[torch.Tensor]:
        """Tensors the step may read that are neither parameters nor buffers, on the model's device
        (plain attributes), as they are now: a replayed program takes them as inputs, as it takes
        buffers (their shapes, dtypes and devices are among :meth:`values`)."""
        found = []
        for _, read in self._tensors:
            tensor = read()
            if isinstance(tensor, torch.Tensor):
                found.append(tensor)
        return found

    def describe(self) -> list[str]:
        """Where the guard reads (for messages and tests)."""
        return [label for label, _ in self._slots] + [label for label, _ in self._tensors]


class _Places:
    """Where a step's Python side may read values from (:meth:`StepGuard.refresh`): each place a
    label and a reader (``slots``), and the tensors to take as inputs (``tensors``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.slots: dict[str, Callable[[], Any]] = {}
        self.tensors: dict[int, tuple[str, Callable[[], Any]]] = {}
        #: the model's parameters and buffers (inputs already)
        self.held = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
        self.device = next((t.device for t in model.parameters()), None)

    def attributes(
        self,
        namespace: dict[str, Any],
        where: str,
        *,
        module: bool = False,
        depth: int = 1,
    ) -> None:
        for name, value in list(namespace.items()):
            if module and name in _MODULE_INTERNALS:
                continue
            label = f"the attribute {name} {where}"
            if isinstance(value, torch.Tensor):
                self.tensor(value, _item(namespace, name), label)
            elif frozen_value(value) is not _UNSEEN:
                self.slots[label] = _attribute(namespace, name)
            elif depth > 0 and _plain_object(value):
                self.attributes(vars(value), f"of {name} {where}", depth=depth - 1)

    def tensor(
        self,
        tensor: torch.Tensor,
        read: Callable[[], Any],
        label: str,
    ) -> None:
        if id(tensor) in self.held or id(tensor) in self.tensors:
            return
        if self.device is not None and tensor.device == self.device and not on_host(self.device):
            # an input, read where it is kept at every step (a new tensor there is followed)
            self.tensors[id(tensor)] = (label, read)
            self.slots[label] = functools.partial(_layout_of, read)
        else:  # a tensor a program would keep as a constant: replaced or changed in place, a new program
            self.slots[label] = functools.partial(_version_of, read)

    def globals_named(
        self,
        function: types.FunctionType,
        where: str,
    ) -> None:
        namespace = function.__globals__
        for name in _names(function.__code__):
            value = namespace.get(name, _UNSEEN)
            if isinstance(value, torch.Tensor):
                self.tensor(value, _item(namespace, name), f"the global {name} {where}")
            elif value is not _UNSEEN and frozen_value(value) is not _UNSEEN:
                self.slots[f"the global {name} {where}"] = _attribute(namespace, name)

    def function(
        self,
        function: Any,
        where: str,
        *,
        depth: int,
    ) -> None:
        if depth > 2:
            return
        if isinstance(function, functools.partial):
            self.slots[f"the arguments of {where} (a functools.partial)"] = functools.partial(
                _partial_values, function
            )
            for number, value in enumerate(function.args):
                if isinstance(value, torch.Tensor):
                    self.tensor(
                        value,
                        functools.partial(_argument, function, number),
                        f"argument {number} of {where}",
                    )
            self.function(function.func, where, depth=depth + 1)
            return
        if isinstance(function, types.MethodType):
            owner = function.__self__
            if owner is not self.model and hasattr(owner, "__dict__"):
                self.attributes(vars(owner), f"of the object {where} is bound to")
            function = function.__func__
        if isinstance(function, types.FunctionType):
            self.slots[f"which function {where} is"] = functools.partial(_code_of, function)
            self.slots[f"the defaults of {where}"] = functools.partial(_defaults_of, function)
            for name, cell in zip(function.__code__.co_freevars, function.__closure__ or (), strict=True):
                label = f"the variable {name} of {where}'s closure"
                try:
                    value = cell.cell_contents
                except ValueError:  # not yet bound
                    continue
                if isinstance(value, torch.Tensor):
                    self.tensor(value, functools.partial(_cell_contents, cell), label)
                elif isinstance(value, torch.nn.Module):
                    continue  # (the model itself, or a module the guard does not own)
                elif frozen_value(value) is not _UNSEEN:
                    self.slots[label] = functools.partial(_cell_value, cell)
                elif _plain_object(value):
                    self.attributes(vars(value), f"of {name} in {where}'s closure")
                elif callable(value):
                    self.function(value, f"{name} in {where}'s closure", depth=depth + 1)
            self.globals_named(function, f"named by {where}")
            return
        if callable(function) and not isinstance(function, torch.nn.Module) and hasattr(function, "__dict__"):
            self.slots[f"which object {where} is"] = functools.partial(id, function)
            self.attributes(vars(function), f"of {where}")
            call = vars(type(function)).get("__call__")
            if isinstance(call, types.FunctionType):
                self.globals_named(call, f"named by {where}")


def _functions_of(kind: type) -> Iterator[types.FunctionType]:
    for klass in kind.__mro__:
        if klass.__module__.startswith("torch.") or klass is object:
            continue
        for value in vars(klass).values():
            if isinstance(value, types.FunctionType):
                yield value


def _names(code: types.CodeType) -> Iterator[str]:
    """The global names ``code`` (and the functions defined inside it) may read."""
    yield from code.co_names
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _names(constant)


def _plain_object(value: Any) -> bool:
    """An object whose attributes are settings (a dataclass, a namespace), not a module, tensor, function or class."""
    return (
        hasattr(value, "__dict__")
        and not isinstance(value, torch.nn.Module | torch.Tensor | type | types.ModuleType)
        and not callable(value)
    )


def _attribute(namespace: dict[str, Any], name: str) -> Callable[[], Any]:
    return lambda: frozen_value(namespace.get(name, _MISSING))


def _cell_value(cell: types.CellType) -> Hashable:
    try:
        return frozen_value(cell.cell_contents)
    except ValueError:
        return _MISSING


def _item(namespace: dict[str, Any], name: str) -> Callable[[], Any]:
    return lambda: namespace.get(name)


def _cell_contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return None


def _argument(function: functools.partial[Any], number: int) -> Any:
    return function.args[number] if number < len(function.args) else None


def _version_of(read: Callable[[], Any]) -> Hashable:
    tensor = read()
    if not isinstance(tensor, torch.Tensor):
        return frozen_value(tensor)
    return ("tensor", id(tensor), tensor._version, tuple(tensor.shape), tensor.dtype, str(tensor.device))


def _layout_of(read: Callable[[], Any]) -> Hashable:
    tensor = read()
    if not isinstance(tensor, torch.Tensor):
        return frozen_value(tensor)
    return ("input", tuple(tensor.shape), tensor.dtype, str(tensor.device), tensor.requires_grad)


def _autocast(device_type: str) -> Hashable:
    enabled = torch.is_autocast_enabled(device_type)
    return ("autocast", enabled, str(torch.get_autocast_dtype(device_type)) if enabled else None)


def _code_of(function: types.FunctionType) -> Hashable:
    return id(function.__code__)


def _defaults_of(function: types.FunctionType) -> Hashable:
    kwdefaults = function.__kwdefaults__ or {}
    return (frozen_value(list(function.__defaults__ or ())), frozen_value(dict(kwdefaults)))


def _partial_values(function: functools.partial[Any]) -> Hashable:
    return (frozen_value(list(function.args)), frozen_value(dict(function.keywords)))


def _shown(value: Hashable) -> str:
    """A snapshot of :func:`frozen_value` as the value it was."""
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "f":
        return repr(float.fromhex(str(value[1])))
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and value[0] in ("int", "bool", "str", "bytes", "NoneType")
    ):
        return repr(value[1])
    if value == _MISSING:
        return "missing"
    if isinstance(value, tuple) and value and value[0] == "tensor":
        return f"a tensor at version {value[2]}"
    if isinstance(value, tuple) and value and value[0] == "autocast":
        return f"on, {value[2]}" if value[1] else "off"
    if isinstance(value, tuple) and value and value[0] == "input":
        return f"a tensor of shape {value[1]}"
    return "another value"
