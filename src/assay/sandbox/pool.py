"""A pool of warm namespace sandboxes that all start from one snapshot (a template, plus whatever `setup` did).
A returned sandbox is restored to that snapshot (no copying); one that reported a sandbox error, or every
`check_every`-th return, is health-checked, and one that fails is replaced."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from assay.core.errors import ConfigError
from assay.sandbox.base import Limits
from assay.sandbox.namespace import NamespaceSandbox, NsSnapshot, SandboxError

Setup = Callable[[NamespaceSandbox], None]


class SandboxPool:
    def __init__(self, size: int, limits: Limits | None = None, template: str | Path | NsSnapshot | None = None,
                 setup: Setup | None = None, check_every: int = 64) -> None:
        if size < 1:
            raise ConfigError(f"a sandbox pool needs size >= 1, got {size}")
        self.size, self.limits, self.check_every = size, limits or Limits(), check_every
        self._template, self._setup = template, setup
        self._base = self._make_base()
        self._free: deque[NamespaceSandbox] = deque(NamespaceSandbox(self.limits, self._base) for _ in range(size))
        self._cond = threading.Condition()
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = deque()
        self._errors: dict[int, int] = {}  # id(sandbox) -> its error count when handed out
        self._returns = 0
        self.replaced = 0
        self._closed = False

    @property
    def base(self) -> NsSnapshot:
        """The snapshot every sandbox of the pool starts from and returns to."""
        return self._base

    def _make_base(self) -> NsSnapshot:
        with NamespaceSandbox(self.limits, self._template) as sbx:
            if self._setup is not None:
                self._setup(sbx)
            return sbx.snapshot()  # the snapshot keeps its layers alive after the sandbox closes

    # ---- hand out and take back ----------------------------------------------------------------------------------

    def acquire(self, timeout: float | None = None) -> NamespaceSandbox:
        with self._cond:
            if not self._cond.wait_for(lambda: self._free or self._closed, timeout):
                raise TimeoutError(f"no sandbox free in the pool within {timeout} s")
            return self._hand_out()

    async def aacquire(self) -> NamespaceSandbox:
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._free or self._closed:
                return self._hand_out()
            fut: asyncio.Future = loop.create_future()
            self._waiters.append((loop, fut))
        return await fut

    def _hand_out(self) -> NamespaceSandbox:
        if self._closed:
            raise SandboxError("the sandbox pool is closed")
        sbx = self._free.popleft()
        self._errors[id(sbx)] = sbx.errors
        return sbx

    def release(self, sbx: NamespaceSandbox) -> None:
        """Take a sandbox back: restored to the base snapshot, health-checked when due, replaced if broken."""
        self._returns += 1
        if self._closed:
            sbx.close()
            return
        suspect = sbx.errors != self._errors.pop(id(sbx), sbx.errors) or self._returns % self.check_every == 0
        try:
            sbx.restore(self._base)
            healthy = not suspect or sbx.exec(["/bin/true"], timeout=10).ok
        except SandboxError:
            healthy = False
        if not healthy:
            sbx.close()
            sbx = self._replacement()
        self._put_back(sbx)

    def _put_back(self, sbx: NamespaceSandbox) -> None:
        with self._cond:
            while self._waiters:
                loop, fut = self._waiters.popleft()
                if not fut.done():
                    self._errors[id(sbx)] = sbx.errors
                    loop.call_soon_threadsafe(self._deliver, fut, sbx)
                    return
            self._free.append(sbx)
            self._cond.notify()

    def _replacement(self) -> NamespaceSandbox:
        self.replaced += 1
        try:
            return NamespaceSandbox(self.limits, self._base)
        except SandboxError:  # the launcher restarted and took the base snapshot with it: build it again
            self._base = self._make_base()
            return NamespaceSandbox(self.limits, self._base)

    @contextlib.contextmanager
    def sandbox(self, timeout: float | None = None) -> Iterator[NamespaceSandbox]:
        sbx = self.acquire(timeout)
        try:
            yield sbx
        finally:
            self.release(sbx)

    @contextlib.asynccontextmanager
    async def asandbox(self) -> AsyncIterator[NamespaceSandbox]:
        sbx = await self.aacquire()
        try:
            yield sbx
        finally:
            await asyncio.to_thread(self.release, sbx)

    def _deliver(self, fut: asyncio.Future, sbx: NamespaceSandbox) -> None:
        if fut.cancelled():  # the waiter gave up meanwhile
            self._put_back(sbx)
        else:
            fut.set_result(sbx)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            free, self._free = list(self._free), deque()
            self._cond.notify_all()
        for sbx in free:
            sbx.close()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LeasedSandbox:
    """A sandbox for one episode, taken from a pool on first use and given back (restored to the pool's
    snapshot) on `close`. When the pool has none free it opens a fresh one instead of waiting: an episode
    holds its sandbox across turns, and in a lockstep batch more episodes may need one than the pool has."""

    def __init__(self, pool: SandboxPool) -> None:
        self._pool = pool
        self._sbx: NamespaceSandbox | None = None
        self._pooled = False
        self.closed = False

    def _get(self) -> NamespaceSandbox:
        if self.closed:
            raise SandboxError("the episode's sandbox was given back; the episode is over")
        if self._sbx is None:
            try:
                self._sbx, self._pooled = self._pool.acquire(timeout=0), True
            except TimeoutError:
                self._sbx = NamespaceSandbox(self._pool.limits, self._pool.base)
        return self._sbx

    def __getattr__(self, name: str) -> Any:  # the Sandbox protocol, on the leased sandbox
        return getattr(self._get(), name)

    def close(self) -> None:
        if self._sbx is not None and not self.closed:
            (self._pool.release if self._pooled else NamespaceSandbox.close)(self._sbx)
        self.closed = True


_shared: dict[tuple, SandboxPool] = {}
_shared_lock = threading.Lock()
SHARED_POOL_SIZE = 8  # warm sandboxes per set of limits in a process (the verifier threads, and some)


def shared_pool(limits: Limits) -> SandboxPool:
    """This process's pool of warm sandboxes with these limits, made on first use."""
    key = tuple(vars(limits).values())
    with _shared_lock:
        if key not in _shared:
            _shared[key] = SandboxPool(SHARED_POOL_SIZE, limits)
        return _shared[key]
