"""torchrun's elastic agent: a node dies, the agent restarts the group with the nodes left, training resumes.

Two real ``torchrun --nnodes=1:2`` agents on localhost (c10d rendezvous) run ``python -m torchfold
train``: node A with 2 processes, node B with 1. Node B is killed (SIGKILL to its agent and its
worker) mid-run. Node A's workers fail, its agent restarts them (``--max-restarts=1``) in a new
rendezvous that now has one node: 2 processes resume from the last checkpoint written by 3. The
steps after that checkpoint are redone exactly once, and the run ends with the parameters of one
uninterrupted process.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from _dist_worker import free_port
from _train_cli import train

from tests.train.test_elastic_training import _cli, _env
from torchfold.train.loop.checkpoint import list_checkpoints, load_checkpoint

# Fast failure detection and a short wait for more nodes: the test's seconds, not production values.
# A node is dead once its heartbeat is older than interval x max_attempt. The agent renews its
# heartbeat only when it is at least one interval old, on a timer of one interval (reading a state
# cached for up to a second), so a live agent's heartbeat is routinely ~2 s old: with 2 attempts
# the other agent (or the agent itself) would drop it from the rendezvous, and two live nodes
# could form two jobs under one run id. 5 s leaves room for an agent stalled by a loaded machine.
RDZV_CONF = (
    "join_timeout=60,last_call_timeout=5,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=5"
)


def _agent(port: int, nproc: int, args: list[str], log: Path, *, host: bool) -> subprocess.Popen[str]:
    """A node's torchrun agent; the ``host`` node serves the rendezvous store, the other connects to it."""
    conf = f"{RDZV_CONF},is_host={'true' if host else 'false'}"
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", f"--nproc-per-node={nproc}"),
        *("--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"),
        *("--rdzv-id=torchfold-test", f"--rdzv-conf={conf}", "--monitor-interval=0.2"),
        *("-m", "torchfold", "train", *args),
    ]
    return subprocess.Popen(
        command,
        env=_env(PYTHONUNBUFFERED="1"),  # a killed node's last lines still reach the log
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _descendants(pid: int) -> list[int]:
    """The processes started by ``pid`` and by them, from ``/proc`` (torchrun's workers get sessions of their own)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _logged_steps(text: str) -> list[int]:
    """The steps rank 0 logged as completed (``step N/END | ...`` after step N - 1)."""
    return [int(n) - 1 for n in re.findall(r"^step (\d+)/\d+ \|", text, flags=re.MULTILINE)]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_lost_node_restarts_the_group_with_the_nodes_left_and_no_step_is_applied_twice(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    args = _cli(
        tmp_path, ckpt, "--minibatch-size", "6", "--checkpoint-every", "4", "--log-every", "1", repeat=4
    )
    port = free_port()
    logs = [tmp_path / "node-a.log", tmp_path / "node-b.log"]
    # Node A hosts the rendezvous store (B must not: it is killed), and both start at once: started
    # only once A's store was up, B could join after A's last call on a loaded machine, and A would
    # begin without it.
    node_a = _agent(port, 2, args, logs[0], host=True)
    node_b = _agent(port, 1, args, logs[1], host=False)
    try:
        deadline = time.monotonic() + 120
        while not [s for s, _ in list_checkpoints(ckpt) if s >= 8]:  # two checkpoints by 3 processes
            assert time.monotonic() < deadline, "no checkpoint at step 8 within 120 s: " + logs[0].read_text()
            assert node_a.poll() is None and node_b.poll() is None, logs[0].read_text() + logs[1].read_text()
            time.sleep(0.02)
        for pid in [node_b.pid, *_descendants(node_b.pid)]:  # the node is gone: agent and worker
            os.kill(pid, signal.SIGKILL)
        node_b.wait(timeout=10)
        node_a.wait(timeout=180)
    finally:
        for node in (node_a, node_b):
            for pid in [*_descendants(node.pid), node.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    text = logs[0].read_text() + logs[1].read_text()
    assert node_a.returncode == 0, text
    assert "3 process(es)" in text and "2 process(es)" in text, text
    resumed = re.findall(r"resumed from \S+step-(\d+)\.pt at step (\d+)", text)
    assert len(resumed) == 1 and int(resumed[0][0]) == int(resumed[0][1]), text
    checkpoint = int(resumed[0][0])
    assert checkpoint >= 8 and checkpoint % 4 == 0
    # Steps after the checkpoint that the first group completed are run again once; every step
    # is completed by the group that finished the run exactly once.
    counts = Counter(_logged_steps(text))
    first_group_end = max(s for s in counts if counts[s] == 2) if 2 in counts.values() else checkpoint - 1
    assert set(counts.values()) <= {1, 2}
    assert sorted(counts) == list(range(max(counts) + 1))
    assert [s for s in sorted(counts) if counts[s] == 2] == list(range(checkpoint, first_group_end + 1))
    final_step, final = list_checkpoints(ckpt)[-1]
    assert final_step == max(counts) + 1 and load_checkpoint(final)["world_size"] == 2

    assert train(_cli(tmp_path, tmp_path / "whole", "--minibatch-size", "6", repeat=4)) == 0
    [(whole_step, whole)] = list_checkpoints(tmp_path / "whole")
    assert whole_step == final_step
    torch.testing.assert_close(load_checkpoint(final)["model"], load_checkpoint(whole)["model"])
