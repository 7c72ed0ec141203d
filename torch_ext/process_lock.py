"""The process-wide lock of compiled calls, and which thread compiles in the background.

One re-entrant lock for the process. Compiled calls take it (backend/runtime/serial_calls.py says
why), and so does whatever times kernels on the GPU (kernels/decode_linear_tuning.py): a compile on
the background thread (backend/warm_start/background.py) then never times its candidates while a
call queues its own kernels beside them. At the bottom of the layers, so kernels and every backend
stage reach it.
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
