"""What ``python -m torchfold train`` keeps around the trainer: ``--history``'s JSON lines (one per
step, kept across a resume), ``--checkpoint-dir``'s lock (with their errors in the command's
words) and the loaded data out of the garbage collector's way."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import torch.distributed as dist

from torchfold.train.loop.checkpoint import CheckpointDirLock
from torchfold.train.loop.stats import StepStats

__all__ = ["StepHistory", "check_paths", "frozen_gc", "lock_checkpoint_dir"]


def check_paths(args: argparse.Namespace) -> None:
    """Refuse --history and --checkpoint-dir paths of the wrong kind before any work is done (a
    missing folder of either is made)."""
    if args.history is not None:
        history = Path(args.history)
        if history.is_dir():
            raise ValueError(f"--history {args.history} is a directory; give a file to write JSON lines to")
        # (a missing folder is made when the file is opened, as --checkpoint-dir's is; one that is
        # a file cannot be)
        parent = next((folder for folder in history.parents if folder.exists()), None)
        if parent is not None and not parent.is_dir():
            raise ValueError(
                f"--history {args.history}: {parent} is a file, not a directory; give another path"
            )
    if args.checkpoint_dir is not None:
        directory = Path(args.checkpoint_dir)
        if directory.exists() and not directory.is_dir():
            raise ValueError(
                f"--checkpoint-dir {args.checkpoint_dir} is a file; give a directory (created if missing)"
            )


def lock_checkpoint_dir(args: argparse.Namespace, main_rank: bool) -> CheckpointDirLock | None:
    """Lock --checkpoint-dir on the main rank for the run; every rank raises if it is in use."""
    lock, problem = None, None
    if args.checkpoint_dir is not None and main_rank:
        try:
            lock = CheckpointDirLock(args.checkpoint_dir)
        except ValueError as e:
            problem = f"--checkpoint-dir {e}"
        except OSError as e:
            problem = f"--checkpoint-dir {args.checkpoint_dir}: cannot create it or its lock file ({e})"
    if args.checkpoint_dir is not None and dist.is_available() and dist.is_initialized():
        shared = [problem]
        dist.broadcast_object_list(shared, src=0)  # the other ranks stop too, with rank 0's reason
        problem = shared[0]
    if problem is not None:
        raise ValueError(problem)
    if lock is not None and lock.removed:
        names = ", ".join(path.name for path in lock.removed)
        print(f"--checkpoint-dir: removed the temporary files of interrupted checkpoint writes: {names}")
    return lock


class StepHistory:
    """--history: every step's :class:`StepStats` as a JSON line, written as the run goes (the
    trainer's ``on_step``); nothing until :meth:`open` (the main rank, once the resume step is known)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._handle: TextIO | None = None

    def open(self, resumed_at: int | None) -> None:
        """Open the file: afresh, or on resume keep the lines of the steps before ``resumed_at`` and append."""
        assert self.path is not None
        path = self.path
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)  # (--history runs/h.jsonl makes runs/)
            if resumed_at is None or not Path(path).is_file():
                self._handle = open(path, "w")  # noqa: SIM115
                return
            kept = []
            with open(path) as old:
                for line in old:
                    try:
                        step = json.loads(line)["step"]
                    except (ValueError, KeyError, TypeError):
                        continue  # a line cut short by a crash
                    if isinstance(step, int) and step < resumed_at:
                        kept.append(line if line.endswith("\n") else line + "\n")
            # the kept lines go to a file beside it that then replaces it: a kill in between leaves
            # the old history whole, never a truncated one (the steps the resumed run repeats are
            # written again as it goes)
            target = Path(path).resolve()  # (a symlinked history: its target is rewritten, the link kept)
            spare = target.with_name(target.name + ".resuming")
            try:
                with open(spare, "w") as fresh:
                    fresh.writelines(kept)
                    fresh.flush()
                    os.fsync(fresh.fileno())
                shutil.copymode(target, spare)  # (the file's permissions, as the user set them)
                os.replace(spare, target)
            finally:
                with contextlib.suppress(OSError):
                    spare.unlink()  # (gone already once it replaced the history)
            self._handle = open(path, "a")  # noqa: SIM115
        except OSError as e:
            raise OSError(e.errno, f"--history {path}: cannot write it ({e.strerror or e})") from e

    def record(self, stats: StepStats) -> None:
        """Write the step's line (none before :meth:`open`, e.g. on another rank than the main one)."""
        if self._handle is None:
            return
        try:
            self._handle.write(json.dumps(stats.__dict__) + "\n")
            self._handle.flush()  # a line per step, readable while the run goes on
        except OSError as e:
            raise OSError(
                e.errno,
                f"--history {self.path}: cannot write step {stats.step}'s line ({e.strerror or e}); the run "
                "stopped after that step",
            ) from e

    def close(self) -> None:
        """Close the file (an error closing it is dropped: a failed write was reported already)."""
        handle, self._handle = self._handle, None
        if handle is not None:
            with contextlib.suppress(OSError):
                handle.close()


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """The objects alive now (the parsed trees, which live as long as the run) out of the cyclic GC's
    full collections (and, forked into the workers, out of their copy-on-write pages). Undone at the
    end (``main()`` may run inside a bigger process); nothing where something else had frozen objects
    before."""
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.collect()
        gc.freeze()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()
