"""The runners of one compiled graph, which capture a size together in one forward call.

`RunnerGroup` decides, per capture size, whether a call warms up, captures or replays; the manager
that owns the runners serves them through `GraphServices` (a protocol, so this module and runner.py
need no import of manager.py, which builds them).
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
import tqdm

WARMUP, CAPTURE, REPLAY = "warmup", "capture", "replay"


class GraphServices(Protocol):
    """What runners ask of the manager that owns them (manager.CudaGraphManager): the shared pool,
    capture, capture sizes and the said-once messages. A protocol, so runner.py needs no import of
    the manager that builds runners."""

    num_warmup: int
    bar_disabled: bool | None
    check_addresses: bool

    def capture_size(self, n: int | None, max_size: int | None = None): ...
    def can_capture_on(self, device: torch.device) -> bool: ...
    def capture(self, fn: Callable, args: list, device: torch.device, name: str, size): ...
    def output_view(self, arg: torch.Tensor, size, padded_shape: list[int]) -> torch.Tensor | None: ...
    def note_outputs(self, outs: list, size) -> None: ...
    def note_once(self, key, msg: str, *args) -> None: ...
    def warn_once(self, key, msg: str) -> None: ...
    def warn_cpu_once(self) -> None: ...


class RunnerGroup:
    """The runners (runner.CudaGraphRunner) of one compiled graph. They capture a size in one forward call, in call order:
    the leader (the first capturable runner) counts forward calls and decides when."""

    def __init__(self, manager: GraphServices, name: str):
        self.manager = manager
        self.name = name
        self.runners: list = []
        self.leader = None  # a runner
        self.calls = 0  # forward calls, counted by the leader
        self.steps: dict[Any, int] = {}  # capture size -> calls at it that reached the leader's slow path
        self.capture_call: dict[Any, int] = {}  # capture size -> the call that captures it
        self._bars: dict[Any, Any] = {}
        self._pins_rows: bool | None = None  # decided at the first call, once every runner is in

    def add(self, runner) -> None:
        self.runners.append(runner)
        # Exact-size-only runners lead only when alone: they skip padded calls, which others count on.
        if runner.capturable and (self.leader is None or (self.leader.exact_only and not runner.exact_only)):
            if self.leader is not None:
                self.leader.is_leader = False
            self.leader = runner
            runner.is_leader = True

    def key(self, size, n):
        """What the graphs of a call at batch n are kept under: its capture size, or (size, exact)
        where a runner reads an input with the batch dim in place (a KV cache per batch size) at exact
        sizes only, so padded calls get graphs of their own (that input copied). One key for the whole
        group: its runners capture a key in one forward call."""
        if self._pins_rows is None:
            self._pins_rows = any(r.pins_rows and r.capturable for r in self.runners)
        return (size, n == size) if self._pins_rows else size

    def restart(self, key) -> None:
        """The graphs of `key` were dropped (an in-place input moved): warm up and capture it again."""
        self.steps[key] = 0
        self.capture_call.pop(key, None)

    def phase(self, runner, size) -> str:
        if runner is self.leader:
            steps = self.steps[size] = self.steps.get(size, 0) + 1
            if steps <= self.manager.num_warmup:
                return WARMUP
            if steps == self.manager.num_warmup + 1:
                self.capture_call[size] = self.calls
                return CAPTURE
            return REPLAY
        call = self.capture_call.get(size)
        if call is None:
            return WARMUP
        return CAPTURE if call == self.calls else REPLAY

    def captured(self, key) -> None:
        total = sum(1 for r in self.runners if r.capturable)
        if total < 2:
            return
        bar = self._bars.get(key)
        if bar is None:
            size = key if not isinstance(key, tuple) else f"{key[0]}{'' if key[1] else ' (padded calls)'}"
            bar = self._bars[key] = tqdm.tqdm(
                total=total, desc=f"torch_ext CUDA graphs {self.name} size={size}", unit="graph",
                leave=False, disable=self.manager.bar_disabled)
        bar.update(1)
        if bar.n >= bar.total:
            bar.close()
