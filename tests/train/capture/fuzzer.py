"""``scripts/fuzz_replay.py`` loaded as a module, for the tests that run its scenarios."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]


def load_fuzzer() -> Any:
    """The fuzzer script as the module ``fuzz_replay`` (registered, so its dataclasses pickle)."""
    spec = importlib.util.spec_from_file_location("fuzz_replay", ROOT / "scripts" / "fuzz_replay.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_replay"] = module
    spec.loader.exec_module(module)
    return module
