"""The process-wide lock of compiled calls, and which thread compiles in the background.

One re-entrant lock for the process. Compiled calls take it (backend/runtime/serial_calls.py says
why), and whatever times kernels on the GPU (kernels/decode_linear_tuning.py) waits for it a while
(`quiet`): a compile on the background thread (backend/warm_start/background.py) then does not time
its candidates while a call queues its own kernels beside them. Only a while: that thread holds
Dynamo's compile lock, which a call under this lock may want for a lazy compile (waiting without a
limit could deadlock). At the bottom of the layers, so kernels and every backend stage reach it.
"""
from __future__ import annotations

import contextlib
import threading

LOCK = threading.RLock()
_thread = threading.local()


def in_background() -> bool:
    """True on the thread that compiles programs in the background, while it does."""
    return getattr(_thread, "background", False)


@contextlib.contextmanager
def background():
    """Marks this thread as the background compiler for the block."""
    _thread.background = True
    try:
        yield
    finally:
        _thread.background = False


@contextlib.contextmanager
def quiet(timeout: float = 1.0):
    """The lock for the block if it comes within `timeout` seconds; the block runs either way."""
    held = LOCK.acquire(timeout=timeout)
    try:
        yield held
    finally:
        if held:
            LOCK.release()
