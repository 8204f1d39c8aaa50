"""Calls that arrive while others are being served wait, and are then served together, as one batch.

A thread that finds a free slot leads: it takes the waiting items (its own first) and runs the batch
with its own context; the others wait for their results. Alone, an item is served at once, so a
quiet caller pays no latency; under load, batches grow by themselves to what piled up meanwhile."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
C = TypeVar("C")
R = TypeVar("R")


@dataclass(eq=False)  # calls are told apart by identity, never by their items
class _Call(Generic[T, R]):
    item: T
    done: bool = False
    result: R | None = None
    error: BaseException | None = None
    taken: bool = False  # in a batch (its own or another leader's)


class Coalescer(Generic[T, C, R]):
    def __init__(self, run: Callable[[list[T], C], Sequence[R]], max_batch: int, max_running: int) -> None:
        if max_batch < 1 or max_running < 1:
            raise ValueError(f"max_batch and max_running must be >= 1, got {max_batch}, {max_running}")
        self._run, self.max_batch, self.max_running = run, max_batch, max_running
        self._cv = threading.Condition()
        self._waiting: list[_Call[T, R]] = []
        self._running = 0

    def submit(self, item: T, context: C) -> R:
        call: _Call[T, R] = _Call(item)
        with self._cv:
            self._waiting.append(call)
            while not call.taken and self._running >= self.max_running:
                self._cv.wait()
            if call.taken:  # another leader has it
                while not call.done:
                    self._cv.wait()
                return self._outcome(call)
            self._waiting.remove(call)
            batch = [call, *self._waiting[:self.max_batch - 1]]
            del self._waiting[:self.max_batch - 1]
            for c in batch:
                c.taken = True
            self._running += 1
        try:
            results = list(self._run([c.item for c in batch], context))
            if len(results) != len(batch):
                raise RuntimeError(f"a batch of {len(batch)} returned {len(results)} results")
            for c, r in zip(batch, results, strict=True):
                c.result = r
        except BaseException as e:  # every caller of the batch hears of it
            for c in batch:
                c.error = e
        finally:
            with self._cv:
                self._running -= 1
                for c in batch:
                    c.done = True
                self._cv.notify_all()
        return self._outcome(call)

    @staticmethod
    def _outcome(call: _Call[T, R]) -> R:
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[return-value]
