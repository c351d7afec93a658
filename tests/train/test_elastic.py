"""ElasticConfig: accumulation steps and device batches for the devices present, even and uneven."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from torchfold.train.data.loader import StepLoader
from torchfold.train.distributed.elastic import ElasticConfig
from torchfold.train.distributed.world import world


@pytest.mark.parametrize(
    ("global_batch", "max_device", "devices", "steps", "device_batch", "even"),
    [
        (256, 64, 1, 4, 64, True),
        (256, 64, 2, 2, 64, True),
        (256, 64, 4, 1, 64, True),
        (256, 64, 8, 1, 32, True),
        (256, 64, 3, 2, 43, False),  # 6 slots: 4 x 43 + 2 x 42
        (100, 64, 1, 2, 50, True),
        (100, 30, 3, 2, 17, False),
        (7, 64, 2, 1, 4, False),
        (1, 64, 4, 1, 1, False),  # three devices idle in this step
    ],
)
def test_table(
    global_batch: int, max_device: int, devices: int, steps: int, device_batch: int, even: bool
) -> None:
    c = ElasticConfig(global_batch, max_device, num_replicas=devices)
    assert (c.accumulation_steps, c.device_batch_size, c.num_replicas, c.is_even) == (
        steps,
        device_batch,
        devices,
        even,
    )
    sizes = [size for rank in range(devices) for size in c.batch_sizes(rank)]
    assert sum(sizes) == global_batch
    assert max(sizes) == device_batch <= max_device
    assert max(sizes) - min(sizes) <= 1


def test_uneven_split_fills_the_first_slots() -> None:
    c = ElasticConfig(256, 64, num_replicas=3)
    assert [c.batch_sizes(rank) for rank in range(3)] == [[43, 43], [43, 42], [43, 42]]


@given(st.integers(1, 5000), st.integers(1, 300), st.integers(1, 16))
def test_split_meets_the_global_batch_and_the_maximum(
    global_batch: int, max_device: int, devices: int
) -> None:
    c = ElasticConfig(global_batch, max_device, num_replicas=devices)
    sizes = [c.batch_size(a, rank) for a in range(c.accumulation_steps) for rank in range(devices)]
    assert sum(sizes) == global_batch
    assert max(sizes) <= max_device and max(sizes) - min(sizes) <= 1
    # No fewer accumulation steps would fit under the maximum.
    assert (c.accumulation_steps - 1) * devices * max_device < global_batch


def test_main_process_and_rank() -> None:
    assert ElasticConfig(64, 32, num_replicas=2).is_main
    assert not ElasticConfig(64, 32, num_replicas=2, rank=1).is_main


def test_detected_devices_in_this_process() -> None:
    # The test machine runs one CPU process without torch.distributed or launcher variables.
    c = ElasticConfig(256, 64)
    assert (c.num_replicas, c.rank, c.source) == tuple(world()) == (1, 0, "single process")
    assert c.num_replicas * c.accumulation_steps * c.max_device_batch_size >= 256


def test_launcher_variables_alone_do_not_make_a_world(monkeypatch: pytest.MonkeyPatch) -> None:
    # The one rule (world()), as the loader and the sampler read it: until a process group
    # exists, WORLD_SIZE / RANK do not connect anything, and a config for 4 devices at rank 3
    # would make this process train on a quarter of every step.
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    # ... and it says so, naming the fix, where a default is taken (it once planned silently)
    unconnected = (
        r"WORLD_SIZE=4 is set .* no process group yet, so this setting plans for 1 process; call "
        + (r"torchfold.train.init_distributed\(\) first")
    )
    with pytest.warns(UserWarning, match=unconnected):
        c = ElasticConfig(256, 64)
    with pytest.warns(UserWarning, match=unconnected):
        assert StepLoader(list(range(8)), 2).num_replicas == 1
    assert (c.num_replicas, c.rank, c.is_main, c.accumulation_steps, c.source) == (
        1,
        0,
        True,
        4,
        "single process",
    )


def test_with_global_batch_size_keeps_the_devices() -> None:
    c = ElasticConfig(256, 64, num_replicas=2, rank=1).with_global_batch_size(96)
    assert (c.num_replicas, c.rank, c.accumulation_steps, c.batch_sizes()) == (2, 1, 1, [48])


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((0, 64), {}, ValueError, "global_batch_size must be a positive int, got 0"),
        ((256, -1), {}, ValueError, "max_device_batch_size must be a positive int, got -1"),
        ((256.0, 64), {}, TypeError, "global_batch_size must be an int, got float"),
        ((True, 64), {}, TypeError, "global_batch_size must be an int, got bool"),
        ((256, 64), {"num_replicas": 0}, ValueError, "num_replicas must be a positive int, got 0"),
        (
            (256, 64),
            {"num_replicas": 2, "rank": 2},
            ValueError,
            r"Invalid rank 2, rank should be in the interval \[0, 1\]",
        ),
    ],
)
def test_bad_arguments(args: tuple, kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ElasticConfig(*args, **kwargs)


def test_bad_lookups() -> None:
    c = ElasticConfig(256, 64, num_replicas=2)
    with pytest.raises(ValueError, match=r"accumulation_step must be in \[0, 1\], got 2"):
        c.batch_size(2)
    with pytest.raises(ValueError, match="Invalid rank 5"):
        c.batch_size(0, rank=5)


def test_num_replicas_is_the_device_count_and_world_size_num_devices_deprecated_aliases() -> None:
    new = ElasticConfig(100, 20, 3)  # positional, as before
    with pytest.warns(FutureWarning, match=r"ElasticConfig\(world_size=\) is deprecated; use num_replicas="):
        old = ElasticConfig(100, 20, world_size=3)
    assert new.num_replicas == old.num_replicas == 3 and new.minibatch_sizes() == old.minibatch_sizes()
    with pytest.warns(
        FutureWarning, match=r"ElasticConfig.num_devices is deprecated; use ElasticConfig.num_replicas"
    ):
        assert old.num_devices == 3
    with pytest.raises(TypeError, match="give num_replicas=3, not also the deprecated world_size=2"):
        ElasticConfig(100, 20, 3, world_size=2)
