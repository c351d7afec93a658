"""Training checkpoints: written atomically, read with ``torch.load(weights_only=True)``, checked.

A checkpoint is a dict of tensors and plain containers (dicts, lists, tuples, ints, floats,
strings, ``None``), so it loads without unpickling arbitrary objects. :func:`save_checkpoint`
writes it to a temporary file in the same directory, flushes it to disk and renames it over the
target with ``os.replace``: a run killed while saving leaves the previous checkpoint intact and
never a half-written file under a checkpoint's name. The archive ends with a SHA-256 digest of
itself (in the zip's comment), and :func:`load_checkpoint` checks it before ``torch.load`` trusts a
byte: a flipped bit anywhere is an error, never a resume from other values. It turns every way a
file can be unusable (missing, truncated, damaged, not a torchfold checkpoint, a newer format,
a name that says another step than its content) into an error that names the file and says what
to do.

Checkpoints of a run live in one directory as ``step-00000120.pt`` (the number of optimizer
steps completed, i.e. the global trace step to resume at); :func:`latest_checkpoint` finds the
newest and :func:`prune_checkpoints` keeps the last few.

A trainer checkpoint holds every process's generator states, captured by
:func:`~torchfold.train.loop.rng.rng_state` (tensors and plain containers too);
:func:`check_trainer_state` checks them with :func:`~torchfold.train.loop.rng.rng_state_problem`.

:class:`CheckpointDirLock` keeps a second run off a directory that a run is writing to (an
``fcntl.flock`` on ``DIR/.lock``, released by the kernel when the holder exits, however it exits),
and removes the temporary files that killed runs left there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import math
import os
import pickle
import re
import socket
import struct
import zipfile
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, cast

import torch

from torchfold._validate import brief, check_int
from torchfold.train.distributed.devices import CHECKPOINT_MAP_LOCATION, on_host
from torchfold.train.loop import rng as generators

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_VERSION",
    "CheckpointDirLock",
    "HyperparameterMismatch",
    "check_trainer_state",
    "checkpoint_path",
    "keep_hyperparameters",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "prune_checkpoints",
    "save_checkpoint",
    "set_aside_checkpoints",
]

CHECKPOINT_FORMAT = "torchfold.checkpoint"
CHECKPOINT_VERSION = 1
_NAME = re.compile(r"^step-(\d+)\.pt$")
# What save_checkpoint writes before renaming it to the checkpoint's name (``PID``: the writer's).
_TEMPORARY = re.compile(r"^\.step-\d+\.pt\.tmp-\d+$")


def checkpoint_path(directory: str | os.PathLike[str], step: int) -> Path:
    """Where the checkpoint taken after ``step`` completed optimizer steps lives in ``directory``.

    >>> checkpoint_path("runs/a", 120).as_posix()
    'runs/a/step-00000120.pt'
    """
    check_int("step", step, 0, hint="the optimizer step the checkpoint is taken after")
    return Path(directory) / f"step-{step:08d}.pt"


def list_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step-N.pt`` file in ``directory``, oldest first (empty if none)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _NAME.match(entry.name)
        if match and entry.is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint with the most completed steps in ``directory``, or ``None``.

    >>> latest_checkpoint("/no/such/dir") is None
    True
    """
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def prune_checkpoints(directory: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest checkpoints in ``directory``; returns the deleted paths."""
    check_int("keep", keep, hint="how many checkpoints to keep")
    old = [path for _, path in list_checkpoints(directory)[:-keep]]
    for path in old:
        path.unlink(missing_ok=True)
    return old


def set_aside_checkpoints(directory: str | os.PathLike[str]) -> tuple[Path, int] | None:
    """Move the checkpoints in ``directory`` to a new subdirectory ``earlier-N`` (the first free N).

    For a fresh run in a directory that holds an earlier run's checkpoints: left beside the new
    run's, they would mix with them (pruning keeps the highest steps, maybe the earlier run's, and
    a resume takes the highest). Moved, nothing is lost. Returns the subdirectory and how many
    checkpoints moved there, or ``None`` when there were none.

    Example:
        >>> import tempfile
        >>> directory = Path(tempfile.mkdtemp())
        >>> _ = save_checkpoint({"step": 3}, checkpoint_path(directory, 3))
        >>> aside, moved = set_aside_checkpoints(directory)
        >>> aside.name, moved, list_checkpoints(directory)
        ('earlier-1', 1, [])
    """
    found = [path for _, path in list_checkpoints(directory)]
    if not found:
        return None
    directory = Path(directory)
    number = 1
    while (directory / f"earlier-{number}").exists():
        number += 1
    aside = directory / f"earlier-{number}"
    try:
        aside.mkdir()
        for path in found:
            path.rename(aside / path.name)
    except OSError as e:
        raise OSError(
            e.errno, f"cannot move the earlier checkpoints in {directory} to {aside} ({e.strerror or e})"
        ) from e
    return aside, len(found)


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``state`` (tensors and plain containers) to ``path`` atomically.

    The data goes to a temporary file next to ``path``, is flushed to disk, and replaces
    ``path`` in one ``os.replace``; the directory is created if needed.

    Args:
        state: the checkpoint; :func:`load_checkpoint` expects the keys ``format``
            (:data:`CHECKPOINT_FORMAT`) and ``version``, which are added when missing.
        path: the file to write.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     path = save_checkpoint({"step": 3, "w": torch.ones(2)}, checkpoint_path(d, 3))
    ...     load_checkpoint(path)["step"]
    3
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # On the host: a file of XLA (or CUDA) storages cannot be read back with weights_only, nor
    # on a machine without that device; loading copies the values into the model's own tensors.
    state = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, **_on_host(state)}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w+b") as handle:
            digest = _Digesting(handle)
            torch.save(state, cast(IO[bytes], digest))  # (torch only calls its write())
            _append_digest(handle, digest.sha256.hexdigest())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        interrupt = next((c for c in _chain(e) if isinstance(c, KeyboardInterrupt)), None)
        if interrupt is not None:
            # Ctrl-C while torch.save wrote: its writer turns the KeyboardInterrupt raised in a
            # write into "[enforce fail at inline_container.cc] unexpected pos"; the interrupt it is.
            raise interrupt from None
        cause = next((c for c in _chain(e) if isinstance(c, OSError) and c.errno is not None), None)
        if cause is None:
            raise
        # torch.save reports a failed write as "[enforce fail at inline_container.cc] unexpected pos";
        # the OSError it swallowed says why (a full disk, a quota, a read-only filesystem).
        earlier = [p for _, p in list_checkpoints(path.parent) if p != path]
        intact = (
            f"the earlier checkpoints are intact (newest: {earlier[-1]})"
            if earlier
            else "no earlier checkpoint was changed"
        )
        raise OSError(
            cause.errno,
            f"cannot write checkpoint {path}: {cause.strerror or cause}; nothing was written under "
            f"its name and {intact}",
        ) from e
    finally:
        tmp.unlink(missing_ok=True)
    # Make the rename itself durable (a crash right after must not bring the old name back).
    if hasattr(os, "O_DIRECTORY"):
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return path


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, then each exception in its chain of causes and contexts."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        yield current
        seen.add(id(current))
        current = current.__cause__ or current.__context__


# -- the digest at the end of a checkpoint -----------------------------------------------------
#
# NOTE: the zip's own CRCs do not cover everything torch's reader trusts: a flipped bit in an
# entry's attributes in the central directory (it then reads a tensor as a directory) or in its
# sizes loads other values without an error, and zipfile.testzip() passes. So the archive carries
# a SHA-256 of all of itself, in the end-of-central-directory comment that zip readers (torch's
# miniz, zipfile) skip; checking it costs one read of the file (about 1 GB/s), beside the read of
# torch.load that follows from the page cache.

_DIGEST_PREFIX = b"torchfold sha256 "
_DIGEST_LENGTH = len(_DIGEST_PREFIX) + 64  # the comment: the prefix and 64 hex digits
_END_OF_DIRECTORY = b"PK\x05\x06"  # the signature of the zip's last record (22 bytes, then the comment)


class _Digesting(io.RawIOBase):
    """A write-only stream that hashes what it passes on to ``handle`` (``torch.save`` writes in order)."""

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle = handle
        self.sha256 = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.sha256.update(data)
        return self.handle.write(data)


def _append_digest(handle: IO[bytes], digest: str) -> None:
    """Put ``digest`` (of the archive as ``torch.save`` wrote it) into the zip's comment.

    The archive ends with the 22-byte end-of-central-directory record, whose last two bytes are
    the comment's length (0 as torch writes it): those become the digest's, and the digest follows.
    An archive that does not end so is left as it is (checked by its CRCs when read).
    """
    handle.seek(-22, os.SEEK_END)
    record = handle.read(22)
    if not record.startswith(_END_OF_DIRECTORY) or record[-2:] != b"\x00\x00":
        return
    handle.seek(-2, os.SEEK_END)
    handle.write(struct.pack("<H", _DIGEST_LENGTH) + _DIGEST_PREFIX + digest.encode("ascii"))


def _damage(path: Path) -> str | None:
    """What is wrong with the bytes of checkpoint ``path``, as ``"it is ..."`` (``None``: nothing found).

    A file with a digest (:func:`save_checkpoint` writes one) is checked against it; an older one
    without, by its zip CRCs (``zipfile.testzip``).
    """
    size = path.stat().st_size
    if size == 0:
        return "it is empty"
    with path.open("rb") as handle:
        head = handle.read(4)
        if size >= 22 + _DIGEST_LENGTH:
            handle.seek(-(_DIGEST_LENGTH + 22), os.SEEK_END)
            tail = handle.read()
            record, comment = tail[:22], tail[22:]
            if (
                record.startswith(_END_OF_DIRECTORY)
                and record[-2:] == struct.pack("<H", _DIGEST_LENGTH)
                and comment.startswith(_DIGEST_PREFIX)
            ):
                sha256 = hashlib.sha256()
                handle.seek(0)
                remaining = size - _DIGEST_LENGTH - 2
                while remaining > 0:
                    chunk = handle.read(min(remaining, 1 << 20))
                    if not chunk:
                        break
                    sha256.update(chunk)
                    remaining -= len(chunk)
                sha256.update(b"\x00\x00")  # the comment's length as torch.save wrote it
                if sha256.hexdigest().encode("ascii") != comment[len(_DIGEST_PREFIX) :]:
                    return "it is damaged (its SHA-256 digest does not match its content)"
                return None
    if head != b"PK\x03\x04":
        return f"it is not a torchfold checkpoint, or it is damaged (not a zip archive as torch.save writes: it begins with {head!r})"
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, EOFError, OSError, RuntimeError, ValueError, NotImplementedError) as e:
        return f"it is truncated or damaged (its zip archive: {e})"
    return None if bad is None else f"it is damaged (its member {bad!r} fails its CRC check)"


class CheckpointDirLock:
    """An exclusive lock on a checkpoint directory for the life of a run (``fcntl.flock`` on ``DIR/.lock``).

    Two runs writing ``step-N.pt`` into one directory would overwrite each other's checkpoints
    and resume from a mixture. The lock file records the holder's pid and host, so the run
    refused can name it; the kernel releases the lock when the holder exits, also when it is
    killed, so a crashed run never leaves the directory locked. Creates the directory.

    A run killed while it wrote a checkpoint leaves its temporary file (``.step-N.pt.tmp-PID``,
    as large as a checkpoint); with the lock held no other run writes here, so those found are
    leftovers: they are removed, and listed in :attr:`removed`.

    Raises:
        ValueError: ``directory`` is a file, or another process holds the lock.
        OSError: the directory or its lock file cannot be created.
    """

    NAME = ".lock"

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"checkpoint directory {self.directory} is a file, not a directory")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / self.NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                os.close(fd)
                raise
            holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise ValueError(
                f"checkpoint directory {self.directory} is in use by {holder}: wait for that run to end, or use "
                "another directory"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode())
        self._fd: int | None = fd
        #: the temporary files of interrupted writes found in the directory and removed
        self.removed = _remove_temporaries(self.directory)

    def release(self) -> None:
        """Give the directory back (also done by the kernel when the process exits)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> CheckpointDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _remove_temporaries(directory: Path) -> list[Path]:
    """Remove the temporary files of :func:`save_checkpoint` in ``directory`` but this process's."""
    mine = f".tmp-{os.getpid()}"
    removed = []
    for entry in sorted(directory.iterdir()):
        if _TEMPORARY.match(entry.name) and not entry.name.endswith(mine) and entry.is_file():
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def _on_host(value: Any) -> Any:
    """``value`` with every tensor on a device other than the CPU copied to the CPU (containers rebuilt)."""
    if isinstance(value, torch.Tensor):
        return value if on_host(value.device) else value.detach().cpu()
    if isinstance(value, dict):
        return {key: _on_host(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        items = [_on_host(item) for item in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _loads_on_the_host(path: Path, map_location: str | torch.device) -> bool:
    """Whether ``path`` loads on the CPU (only tried where ``map_location`` is another place)."""
    try:
        if on_host(map_location):
            return False  # it failed there already
    except (RuntimeError, TypeError):
        pass  # a place torch.device does not parse: try the CPU
    try:
        torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        return False
    return True


def _check_name(path: Path, step: Any) -> None:
    """A checkpoint named ``step-N.pt`` must hold step N: resuming and pruning go by the name."""
    match = _NAME.match(path.name)
    if match is None or isinstance(step, bool) or not isinstance(step, int) or step == int(match.group(1)):
        return
    named = int(match.group(1))
    right = checkpoint_path(path.parent, step) if step >= 0 else None
    if right is None:
        fix = "delete it"
    elif right.exists():
        fix = f"delete it ({right} holds step {step} under its own name)"
    else:
        fix = f"rename it to {right}, or delete it"
    raise ValueError(
        f"checkpoint {path} holds step {step}, but its name says step {named}: it was renamed or copied, and "
        f"resuming and pruning go by the name; {fix}"
    )


def _fix(path: Path) -> str:
    """What to do about an unusable checkpoint: fall back to the previous one, or start afresh."""
    earlier = [p for _, p in list_checkpoints(path.parent) if p != path]
    if _NAME.match(path.name) and earlier:
        return f"delete it to resume from the previous checkpoint {earlier[-1]}, or start without resuming"
    return "delete it (or point to another checkpoint) and start without resuming"


def load_checkpoint(
    path: str | os.PathLike[str], map_location: str | torch.device | None = None
) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`, with ``torch.load(weights_only=True)``.

    The rule for resuming (:meth:`torchfold.train.TraceTrainer.load_checkpoint`
    and ``python -m torchfold train`` follow it, through their
    :attr:`RunContext.map_location <torchfold.train.RunContext.map_location>`): read on the host,
    the default, then let ``load_state_dict`` copy the values into the model's and the optimizer's
    tensors on their devices. ``torch.load`` cannot place a storage on an XLA device, and a host
    read works on a machine of any kind.

    Args:
        path: the checkpoint file.
        map_location: where to put its tensors (default
            :data:`~torchfold.train.distributed.devices.CHECKPOINT_MAP_LOCATION`, the CPU).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is truncated, corrupt, not a torchfold checkpoint, or of a newer
            format version, or its tensors cannot go to ``map_location``; the message names the
            file and the fix (and calls a file corrupt only when its archive is).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if map_location is None:
        map_location = CHECKPOINT_MAP_LOCATION
    damage = _damage(path)
    if damage is not None:
        raise ValueError(f"checkpoint {path} cannot be read: {damage}; {_fix(path)}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        if isinstance(e, pickle.UnpicklingError):
            # (torch's message goes on to advise weights_only=False: not for a file of unknown origin)
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
            what = f" (it holds a {found.group(1)})" if found else ""
            raise ValueError(
                f"checkpoint {path} cannot be read: it holds objects other than tensors and plain containers"
                f"{what}, so it is not a torchfold checkpoint; {_fix(path)}"
            ) from None
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        cause = f"({type(e).__name__}: {reason})"
        if not _loads_on_the_host(path, map_location):
            raise ValueError(
                f"checkpoint {path} cannot be read: it is damaged (torch cannot read its archive: {cause[1:-1]}); "
                f"{_fix(path)}"
            ) from e
        raise ValueError(
            f"checkpoint {path} is intact, but its tensors cannot be loaded with map_location={map_location!r} "
            f"{cause}; load it on the CPU (the default) and let load_state_dict copy the values to the device"
        ) from e
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        what = (
            f"a dict with keys {sorted(map(str, state))[:8]}"
            if isinstance(state, dict)
            else type(state).__name__
        )
        raise ValueError(
            f"checkpoint {path} is not a torchfold checkpoint (it holds {what}, without "
            f"format={CHECKPOINT_FORMAT!r}); {_fix(path)}"
        )
    version = state.get("version")
    if not isinstance(version, int) or version > CHECKPOINT_VERSION:
        raise ValueError(
            f"checkpoint {path} has format version {version!r}, but this torchfold reads versions up to "
            f"{CHECKPOINT_VERSION}; upgrade torchfold, or {_fix(path)}"
        )
    _check_name(path, state.get("step"))
    return state


# -- checking what a checkpoint holds ---------------------------------------------------------

_DAMAGED = "the file was damaged or edited: use another checkpoint, or start without resuming"


def check_trainer_state(
    state: Mapping[str, Any],
    source: str,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    settings: Mapping[str, Any] | None = None,
) -> None:
    """Check a trainer checkpoint before any of it is used: its entries, step, world size, generator
    states, learning rates and loader position, and that it fits this run's optimizer and settings.

    A file can load and still hold values that no run writes; each is a ``ValueError`` naming
    ``source`` (the file), the entry and its value, raised before anything has been restored.
    The world size it was written with may differ from this run's (training is world-size
    invariant); it must only agree with the number of generator states it holds.

    Args:
        state: the checkpoint, as :meth:`TraceTrainer.state_dict <torchfold.train.TraceTrainer.state_dict>`
            writes it.
        source: the file, as named in the message (``"checkpoint runs/a/step-00000120.pt"``).
        optimizer: this run's (wrapped) optimizer: an Adam's saved state must hold what its update reads.
        settings: this run's settings (``TraceTrainer(settings=)``): a saved one must have the same value.
    """
    missing = sorted({"step", "world_size", "model", "optimizer", "loader", "rng"} - set(state))
    if missing:
        raise ValueError(f"{source} lacks {missing}: it was not written by TraceTrainer.save_checkpoint")
    _check_step_and_generators(state, source)
    _check_learning_rates(state["optimizer"], source)
    loader_step = (
        state["loader"].get("sampler", {}).get("next_step") if isinstance(state["loader"], dict) else None
    )
    if isinstance(loader_step, int) and loader_step != state["step"]:
        raise ValueError(
            f"{source}: its step {state['step']} is not where its loader stands (next_step {loader_step}): the "
            "file was damaged or edited; use another checkpoint, or start without resuming"
        )
    if optimizer is not None:
        _check_adam_state(state["optimizer"], optimizer, source)
    saved_settings = state.get("settings", {})
    for name, value in (settings or {}).items():
        if name in saved_settings and saved_settings[name] != value:
            raise ValueError(
                f"{source} was written with {name} {saved_settings[name]!r}, this run has {name} {value!r}; "
                f"resume with {name} {saved_settings[name]!r}, or start afresh in another checkpoint directory"
            )


# The hyperparameters a checkpoint's optimizer state holds that loading it silently puts back.
HYPERPARAMETERS = ("lr", "momentum")


class HyperparameterMismatch(ValueError):
    """A checkpoint was written with another optimizer, or another hyperparameter value, than this run's.

    Raised by :func:`keep_hyperparameters`; :attr:`name` is ``"optimizer"`` (then :attr:`saved` and
    :attr:`value` are ``"adam"`` or ``"sgd"``) or the hyperparameter (``"lr"``, ``"momentum"``).
    """

    def __init__(self, source: str, name: str, saved: Any, value: Any) -> None:
        self.source, self.name, self.saved, self.value = source, name, saved, value
        if name == "optimizer":
            fix = "resume with that optimizer, or start afresh in another checkpoint directory"
        else:
            fix = f"resume with {name}={saved!r}, or keep {name}={value!r} with keep_hyperparameters(override=[{name!r}])"
        super().__init__(f"{source} was written with {name} {saved!r}, this run has {name} {value!r}; {fix}")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.source, self.name, self.saved, self.value)


def _optimizer_kind(group: Mapping[str, Any]) -> str | None:
    """``"adam"`` (a group with ``betas``), ``"sgd"`` (with ``momentum``) or ``None``."""
    return "adam" if "betas" in group else "sgd" if "momentum" in group else None


@contextlib.contextmanager
def keep_hyperparameters(
    state: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    source: str,
    *,
    override: Collection[str] = (),
) -> Iterator[dict[str, tuple[float, float]]]:
    """Load a trainer checkpoint inside this context to resume with this run's hyperparameters.

    A checkpoint's optimizer state holds the learning rate and momentum it was written with, and
    loading it would silently put them back over this run's. On entry, a different optimizer
    (Adam and SGD told apart by their param groups) or a different ``lr`` or ``momentum`` raises
    :class:`HyperparameterMismatch`, unless the name is in ``override``: then the run's value is
    put back into every param group when the block ends without an error.

    Args:
        state: the checkpoint, as :meth:`TraceTrainer.state_dict <torchfold.train.TraceTrainer.state_dict>`
            writes it (a state that is not one is left to ``load_state_dict`` to refuse).
        optimizer: this run's optimizer (or :class:`~torchfold.train.AccumulatingOptimizer`), as
            configured, before the checkpoint is loaded into it.
        source: the file, as named in messages (``"checkpoint runs/a/step-00000120.pt"``).
        override: the hyperparameters this run keeps, e.g. ``["lr"]``.

    Yields:
        Per overridden hyperparameter that differs, ``(the checkpoint's value, this run's)``.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> saved = {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9).state_dict()}
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        >>> with keep_hyperparameters(saved, optimizer, "checkpoint a.pt", override=["lr"]) as kept:
        ...     optimizer.load_state_dict(saved["optimizer"])
        >>> kept, optimizer.param_groups[0]["lr"]
        ({'lr': (0.1, 0.05)}, 0.05)
    """
    unknown = sorted(set(override) - set(HYPERPARAMETERS))
    if isinstance(override, str) or unknown:
        raise ValueError(
            f"keep_hyperparameters(override={override!r}): give a list of {list(HYPERPARAMETERS)}"
            + (f", not {unknown}" if unknown and not isinstance(override, str) else "")
        )
    try:
        group = _torch_optimizer_state(state["optimizer"])["param_groups"][0]
        saved_kind = _optimizer_kind(group)
    except (KeyError, IndexError, TypeError):  # not a trainer's checkpoint: load_state_dict says how
        group, saved_kind = {}, None
    current = optimizer.param_groups[0]
    kind = _optimizer_kind(current)
    if saved_kind is not None and kind is not None and saved_kind != kind:
        raise HyperparameterMismatch(source, "optimizer", saved_kind, kind)
    kept: dict[str, tuple[float, float]] = {}
    for name in HYPERPARAMETERS:
        if name not in current or name not in group:
            continue
        saved, value = group[name], current[name]
        # (a value no run writes, e.g. a NaN, is refused by the check of the file, naming it)
        if isinstance(saved, (int, float)) and math.isfinite(saved) and saved >= 0 and saved != value:
            if name not in override:
                raise HyperparameterMismatch(source, name, saved, value)
            kept[name] = (saved, value)
    yield kept
    for name, (_, value) in kept.items():
        for param_group in optimizer.param_groups:
            param_group[name] = value


def _check_step_and_generators(state: Mapping[str, Any], source: str) -> None:
    step, saved_world, rng = state["step"], state["world_size"], state["rng"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(
            f"{source}: its step should be an int >= 0 (steps completed), got {brief(step)}; {_DAMAGED}"
        )
    if isinstance(saved_world, bool) or not isinstance(saved_world, int) or saved_world < 1:
        raise ValueError(
            f"{source}: its world_size should be an int >= 1, got {brief(saved_world)}; {_DAMAGED}"
        )
    if not isinstance(rng, list) or len(rng) != saved_world:
        raise ValueError(
            f"{source}: its rng should be a list of {saved_world} generator states (one per process), "
            f"got {f'a list of {len(rng)}' if isinstance(rng, list) else brief(rng)}; {_DAMAGED}"
        )
    for rank, rank_state in enumerate(rng):
        problem = generators.rng_state_problem(rank_state)
        if problem is not None:
            raise ValueError(
                f"{source}: the generator states of rank {rank} are unusable: {problem}; {_DAMAGED}"
            )


def _torch_optimizer_state(saved: Any) -> Any:
    """The wrapped torch optimizer's state dict in a saved ``AccumulatingOptimizer`` state (its
    keys at the top; torchfold 0.1.0 nested them under ``"optimizer"``); anything else as it is.

    >>> _torch_optimizer_state({"optimizer": {"state": {}, "param_groups": []}, "steps": 3})
    {'state': {}, 'param_groups': []}
    >>> _torch_optimizer_state({"state": {}, "param_groups": [], "steps": 3})["steps"]
    3
    """
    if isinstance(saved, dict) and "param_groups" not in saved and isinstance(saved.get("optimizer"), dict):
        return saved["optimizer"]
    return saved


def _check_learning_rates(optimizer: Any, source: str) -> None:
    optimizer = _torch_optimizer_state(optimizer)
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    for index, group in enumerate(groups if isinstance(groups, list) else []):
        lr = group.get("lr") if isinstance(group, dict) else None
        if isinstance(lr, torch.Tensor) and lr.numel() == 1:
            lr = lr.item()
        if lr is not None and (
            isinstance(lr, bool) or not isinstance(lr, int | float) or not lr >= 0 or lr == math.inf
        ):
            raise ValueError(
                f"{source}: the lr of its optimizer's param group {index} should be a finite number >= 0, got "
                f"{brief(lr)}; {_DAMAGED}"
            )


def _check_adam_state(saved: Any, optimizer: torch.optim.Optimizer, source: str) -> None:
    """An Adam's (or AdamW's) saved per-parameter state must hold what its update reads.

    A state missing ``exp_avg`` loads without complaint and fails mid-training with a bare
    ``KeyError``; refuse it here, naming the file, the parameter and the entry.
    """
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) or not isinstance(saved, dict):
        return
    saved = _torch_optimizer_state(saved)
    per_param, groups = saved.get("state"), saved.get("param_groups")
    if not isinstance(per_param, dict) or not isinstance(groups, list):
        return  # load_state_dict says what does not fit
    amsgrad = {i: bool(g.get("amsgrad")) for g in groups if isinstance(g, dict) for i in g.get("params", [])}
    for index, entries in per_param.items():
        if not isinstance(entries, dict) or not entries:
            continue  # no step yet: the update starts it afresh
        needed = ["step", "exp_avg", "exp_avg_sq", *(["max_exp_avg_sq"] if amsgrad.get(index) else [])]
        missing = [key for key in needed if key not in entries]
        if missing:
            raise ValueError(
                f"{source}: its optimizer state of parameter {index} lacks {missing} ({type(optimizer).__name__} "
                f"needs {needed}, it holds {sorted(entries)}); the file was damaged or edited: use another "
                "checkpoint, or start without resuming"
            )
