"""Where eight threads calling one compiled model lose throughput (issue 46, item 4).

    python bench/dev/thread_handoff.py [--device cuda] [--modes none,piecewise,full] [--calls 200]

For each cudagraph mode and each lock (`rlock`: the process lock as it is; `fifo`: a lock that hands
itself to the longest waiter on release, so a released waiter never wakes to find it taken again),
1 and 8 threads make calls on inputs made per call (as bench/dev/concurrency.py does) or made ahead.
Printed: calls/s (x one thread), and the share of the wall time some thread held the lock (below 1.0:
gaps where nobody was calling; near 1.0 with fewer calls/s: the holder itself ran slower).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.join(BENCH, ".."))
sys.path.insert(0, os.path.join(BENCH, "..", "tests"))

import torch  # noqa: E402

import concurrency_models as cm  # noqa: E402
from harness import print_table  # noqa: E402


class CountingLock:
    """A re-entrant lock that records how long it was held (outermost acquire to release)."""

    def __init__(self, inner):
        self.inner, self.depth, self.since, self.held = inner, 0, 0.0, 0.0

    def acquire(self, blocking=True, timeout=-1):
        got = self.inner.acquire(blocking, timeout)
        if got:
            self.depth += 1
            if self.depth == 1:
                self.since = time.perf_counter()
        return got

    def release(self):
        self.depth -= 1
        if self.depth == 0:
            self.held += time.perf_counter() - self.since
        self.inner.release()

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()


class FifoLock:
    """Re-entrant; on release the lock passes to the thread that waited longest (no barging)."""

    def __init__(self):
        self._state = threading.Lock()
        self._owner = None
        self._depth = 0
        self._waiters = collections.deque()

    def acquire(self, blocking=True, timeout=-1):
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            return True
        with self._state:
            if self._owner is None and not self._waiters:
                self._owner, self._depth = me, 1
                return True
            if not blocking:
                return False
            gate = threading.Lock()
            gate.acquire()
            self._waiters.append((me, gate))
        if gate.acquire(True, timeout):
            return True  # the releaser made us the owner
        with self._state:
            if self._owner == me:  # granted while timing out
                return True
            self._waiters.remove((me, gate))
            return False

    def release(self):
        self._depth -= 1
        if self._depth:
            return
        with self._state:
            if self._waiters:
                me, gate = self._waiters.popleft()
                self._owner, self._depth = me, 1
                gate.release()
            else:
                self._owner = None

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()


def use_lock(lock) -> None:
    from torch_ext import process_lock
    from torch_ext.backend.runtime import serial_calls

    process_lock.LOCK = serial_calls.LOCK = lock


def build(mode: str, device: str):
    """concurrency.py's ext-<mode> column, warmed up at every batch size."""
    import concurrency

    compiled = concurrency.build(f"ext-{mode}", cm.Blocks().to(device).eval())
    with torch.no_grad():
        first = cm.batch(3, device, seed=0)
        torch._dynamo.mark_dynamic(first, 0)
        compiled(first)
        for n in range(1, 9):
            for _ in range(3):
                compiled(cm.batch(n, device, seed=n))
    return compiled


def hammer(compiled, threads: int, calls: int, device: str, premade: bool, lock: CountingLock) -> tuple[float, float]:
    import random

    barrier = threading.Barrier(threads + 1)
    inputs = {t: [cm.batch(random.Random(t * 7 + i).randint(1, 8), device, seed=i) for i in range(calls)]
              for t in range(threads)} if premade else None

    def work(t):
        rng = random.Random(t)
        barrier.wait()
        with torch.no_grad():
            for i in range(calls):
                x = inputs[t][i] if premade else cm.batch(rng.randint(1, 8), device, seed=t * 100003 + i)
                compiled(x)

    pool = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(threads)]
    for p in pool:
        p.start()
    barrier.wait()
    lock.held = 0.0
    start = time.perf_counter()
    for p in pool:
        p.join()
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return threads * calls / wall, lock.held / wall


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--modes", default="none,piecewise,full")
    p.add_argument("--locks", default="rlock,fifo")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    rows = []
    for mode in args.modes.split(","):
        for lock_name in args.locks.split(","):
            lock = CountingLock(threading.RLock() if lock_name == "rlock" else FifoLock())
            use_lock(lock)
            compiled = build(mode, args.device)
            for premade in (False, True):
                best = {}
                for _ in range(args.rounds):  # rounds interleave the thread counts
                    for t in (1, 8):
                        r = hammer(compiled, t, args.calls, args.device, premade, lock)
                        best[t] = max(best.get(t, (0, 0)), r)
                one, eight = best[1], best[8]
                rows.append([mode, lock_name, "made ahead" if premade else "made per call",
                             f"{one[0]:.0f} (held {one[1]:.2f})", f"{eight[0]:.0f} (held {eight[1]:.2f})",
                             f"{eight[0] / one[0]:.2f}x"])
                print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    print(f"\ncalls/s, {args.calls} calls per thread, batch 1..8, {args.device}, torch {torch.__version__}; "
          "held = share of the wall time the lock was held; best of rounds")
    print_table(["mode", "lock", "inputs", "1 thread", "8 threads", "8 / 1"], rows)


if __name__ == "__main__":
    main()
