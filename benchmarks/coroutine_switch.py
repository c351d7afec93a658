"""How to suspend a sample's plain code mid-call: a greenlet, a generator or a thread, timed.

``torchfold.autobatch`` suspends each sample's code where it reads a value and resumes it once
that value's batched call has run. This times one suspend-and-resume round trip with each
mechanism (median of interleaved rounds); generators are the floor but need ``yield`` in the
user's code. Results: ``benchmarks/results/autobatch.md``.

Usage::

    python benchmarks/coroutine_switch.py
"""

from __future__ import annotations

import statistics
import threading
import time

import greenlet

N = 100_000


def greenlet_round_trip() -> float:
    main = greenlet.getcurrent()

    def body() -> None:
        for _ in range(N):
            main.switch()

    task = greenlet.greenlet(body)
    start = time.perf_counter()
    for _ in range(N):
        task.switch()
    return (time.perf_counter() - start) / N * 1e6


def generator_round_trip() -> float:
    def body():  # type: ignore[no-untyped-def]
        for _ in range(N):
            yield

    task = body()
    start = time.perf_counter()
    for _ in range(N):
        next(task)
    return (time.perf_counter() - start) / N * 1e6


def thread_round_trip() -> float:
    count = N // 20
    go, done = threading.Semaphore(0), threading.Semaphore(0)

    def body() -> None:
        for _ in range(count):
            go.acquire()
            done.release()

    worker = threading.Thread(target=body)
    worker.start()
    start = time.perf_counter()
    for _ in range(count):
        go.release()
        done.acquire()
    took = (time.perf_counter() - start) / count * 1e6
    worker.join()
    return took


def main() -> None:
    rounds: dict[str, list[float]] = {"greenlet": [], "generator": [], "thread": []}
    for _ in range(5):  # interleaved
        rounds["greenlet"].append(greenlet_round_trip())
        rounds["generator"].append(generator_round_trip())
        rounds["thread"].append(thread_round_trip())
    for name, values in rounds.items():
        print(
            f"{name}: median {statistics.median(values):.3f} us per round trip, rounds {[round(v, 3) for v in values]}"
        )


if __name__ == "__main__":
    main()
