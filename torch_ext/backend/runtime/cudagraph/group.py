"""The runners of one compiled graph, which capture a size together in one forward call.

`RunnerGroup` decides, per capture size, whether a call warms up, captures or replays; the manager
that owns the runners serves them through `GraphServices` (a protocol, so this module and runner.py
need no import of manager.py, which builds them).
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Protocol

import torch
import tqdm

WARMUP, CAPTURE, REPLAY = "warmup", "capture", "replay"
# Weight sets a group keeps graphs for (regional compilation: one per layer sharing the compiled
# graph). Beyond it the oldest set's graphs are dropped (captured again when its layer comes back).
MAX_WEIGHT_SETS = 256


@dataclasses.dataclass(frozen=True)
class GraphKey:
    """What the graphs of one forward call are kept under, by every runner of a group."""

    size: Any  # the capture size (None: a graph without a dynamic dim)
    padded: bool = False  # graphs of padded calls where the group pins rows: they copy those inputs
    weights: int = 0  # the weight set (RunnerGroup.choose_weights)

    def label(self) -> str:
        return f"{self.size}{' (padded calls)' if self.padded else ''}{f' weights {self.weights}' if self.weights else ''}"


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
        # Weight sets: identical layers compiled one by one (regional compilation) share this group,
        # each passing its own parameters, which graphs read in place. The leader names the set of
        # each forward call by its parameters' addresses; every runner keeps graphs per set, so a
        # layer switch replays the layer's own graphs instead of capturing again (as CUDA graph
        # trees keep a recording per set of static input addresses).
        self.weights = 0  # the set of the forward call now running
        self._weight_sets: dict[tuple[int, ...], tuple[int, list]] = {}  # addresses -> (set, weakrefs)
        self._next_weights = 0

    def add(self, runner) -> None:
        self.runners.append(runner)
        # Exact-size-only runners lead only when alone: they skip padded calls, which others count on.
        if runner.capturable and (self.leader is None or (self.leader.exact_only and not runner.exact_only)):
            if self.leader is not None:
                self.leader.is_leader = False
            self.leader = runner
            runner.is_leader = True

    def key(self, size, n) -> GraphKey:
        """What the graphs of a call at batch n are kept under: its capture size; padded calls get
        graphs of their own where a runner reads an input with the batch dim in place (a KV cache per
        batch size) at exact sizes only (that input copied); and the weight set of the call. One key
        for the whole group: its runners capture a key in one forward call."""
        if self._pins_rows is None:
            self._pins_rows = any(r.pins_rows and r.capturable for r in self.runners)
        return GraphKey(size, bool(self._pins_rows) and n != size, self.weights)

    def choose_weights(self, tensors: list[torch.Tensor]) -> None:
        """The leader's parameters and buffers of this forward call (read in place) name its weight
        set; a new set first drops the sets whose tensors are gone (a model deleted or reloaded with
        assign=True), then the oldest beyond MAX_WEIGHT_SETS."""
        addresses = tuple(t.data_ptr() for t in tensors)
        known = self._weight_sets.get(addresses)
        if known is not None and _alive(addresses, known[1]):
            self.weights = known[0]
            return
        for other, (ws, refs) in list(self._weight_sets.items()):
            if not _alive(other, refs):
                self._drop_weights(other)
        if len(self._weight_sets) >= MAX_WEIGHT_SETS:
            self.manager.note_once(("weight sets", self.name), "torch_ext: %s is called with more than %d sets "
                                   "of weights (layers compiled one by one); the oldest set's CUDA graphs are "
                                   "dropped and captured again when it comes back", self.name, MAX_WEIGHT_SETS)
            self._drop_weights(next(iter(self._weight_sets)))
        self.weights = self._next_weights
        self._next_weights += 1
        self._weight_sets[addresses] = (self.weights, [weakref.ref(t) for t in tensors])

    def _drop_weights(self, addresses) -> None:
        """Drop a weight set's graphs in every runner."""
        ws, _ = self._weight_sets.pop(addresses)
        for runner in self.runners:
            runner.drop_weights(ws)
        for table in (self.steps, self.capture_call, self._bars):
            for key in [k for k in table if k.weights == ws]:
                del table[key]

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
            bar = self._bars[key] = tqdm.tqdm(
                total=total, desc=f"torch_ext CUDA graphs {self.name} size={key.label()}", unit="graph",
                leave=False, disable=self.manager.bar_disabled)
        bar.update(1)
        if bar.n >= bar.total:
            bar.close()


def _alive(addresses: tuple[int, ...], refs: list) -> bool:
    """Whether a weight set's tensors all exist and are where they were (`.data =` and `model.to()`
    move a parameter's memory; new tensors at the old addresses are another set)."""
    for address, ref in zip(addresses, refs):
        t = ref()
        if t is None or t.data_ptr() != address:
            return False
    return True
