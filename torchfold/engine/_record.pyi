from collections.abc import Callable
from typing import Any

class Recorder:
    def __init__(self, tape: Any, groups: dict[Any, Any], node_type: type, group_type: type) -> None: ...

class FastAdd:
    __wrapped__: Callable[..., Any]
    def __init__(self, function: Callable[..., Any]) -> None: ...
    def __get__(self, obj: Any, objtype: Any = None) -> Any: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

class FastSplit:
    __wrapped__: Callable[..., Any]
    def __init__(
        self, function: Callable[..., Any], node_type: type, tape_type: type, group_type: type
    ) -> None: ...
    def __get__(self, obj: Any, objtype: Any = None) -> Any: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

SCRATCH_BYTES_PER_SOURCE: int

def plain_group(
    nodes: dict[tuple[int, ...], int],
    arity: int,
    tape_source: list[int],
    tape_index: list[int],
    source_calls: list[int],
    scratch: bytearray,
) -> tuple[list[tuple[int, int]], list[tuple[list[int], list[int], bytes | None, list[int]]]] | None: ...
