"""An asyncio event loop on its own thread, for a trainer that trains on the main thread.

Async rollouts go on while the main thread trains; sync mode simply waits on the loop.
The rollout side's objects (client, executor) are not thread-safe, so every call into
them goes through :meth:`LoopThread.run` or :meth:`LoopThread.call`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import TypeVar

from areal_mcore.devices import inherit_device

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str = "ppo-asyncio"):
        self.loop = asyncio.new_event_loop()
        self._current = None
        # On the creating (bound) thread's GPU: the weight sync runs CUDA work here.
        self._thread = threading.Thread(target=inherit_device(self.loop.run_forever), name=name,
                                        daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[object, object, T]) -> T:
        """Runs ``coro`` on the loop; blocks until it is done and returns its result (raises
        ``concurrent.futures.CancelledError`` if ``cancel_current`` cancelled it)."""
        self._current = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return self._current.result()
        finally:
            self._current = None

    def cancel_current(self) -> None:
        """Cancels what ``run`` waits for (safe from a signal handler: the wait is the
        main thread's, and a future's cancel only schedules the task's cancellation)."""
        current = self._current
        if current is not None:
            current.cancel()

    def call(self, fn: Callable[..., T], *args) -> T:
        """Calls ``fn(*args)`` on the loop's thread and returns its result."""
        async def call():
            return fn(*args)
        return self.run(call())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
