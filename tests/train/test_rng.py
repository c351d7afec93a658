"""The generators of a run, in one place: seeded, captured into a checkpoint, restored, checked."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from torchfold.train.loop.checkpoint import load_checkpoint, save_checkpoint
from torchfold.train.loop.rng import (
    derived_seed,
    rng_state,
    rng_state_problem,
    seed_generators,
    set_rng_state,
)


def _draws() -> tuple[torch.Tensor, float, float]:
    """One draw from each host generator a minibatch may use: torch, Python's random, NumPy."""
    return torch.rand(3), random.random(), float(np.random.rand())


def test_generator_states_round_trip_through_a_weights_only_checkpoint(tmp_path: Path) -> None:
    state = rng_state()
    expected = _draws()
    path = save_checkpoint({"rng": state}, tmp_path / "rng.pt")
    _draws()  # move every generator on
    set_rng_state(load_checkpoint(path)["rng"])
    again = _draws()
    assert torch.equal(again[0], expected[0]) and again[1:] == expected[1:]


def test_one_seed_sets_every_generator_and_another_seed_changes_every_one() -> None:
    seed_generators(derived_seed(7, 3, 1))
    first = _draws()
    _draws()
    seed_generators(derived_seed(7, 3, 1))
    again = _draws()
    assert torch.equal(again[0], first[0]) and again[1:] == first[1:]
    seed_generators(derived_seed(7, 3, 2))  # the next minibatch of the step
    other = _draws()
    assert not torch.equal(other[0], first[0]) and other[1] != first[1] and other[2] != first[2]


def test_a_captured_state_holds_every_host_generator_and_passes_its_own_check() -> None:
    state = rng_state()
    assert {"torch", "python", "numpy"} <= set(state)
    assert "xla" not in state  # no XLA device given
    assert rng_state_problem(state) is None
    assert (
        rng_state_problem({**state, "xla": True}) == "'xla' should be an int (an XLA device's seed), got True"
    )
    assert (
        rng_state_problem({"python": 0})
        == "expected a dict with 'torch' and 'python' entries, got {'python': 0}"
    )
