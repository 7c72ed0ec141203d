"""CUDA graphs for the torch_ext backend: capture per batch size, replay, pad up to capture sizes.

cudagraph_mode="piecewise": every compiled piece of the split graph is wrapped in a
`CudaGraphRunner`; splitting ops run eagerly between the replays, at the real batch size.
cudagraph_mode="full": the whole split graph, splitting ops included, is one runner; its
splitting ops must be capturable and, when a batch is padded, must leave the padding rows harmless.

A runner called at batch size n (the runtime value of the graph's dynamic dim):
  * n above the largest capture size, or a region that cannot be captured: runs the wrapped
    callable as is (the compiled pieces, without graphs).
  * else P = the smallest capture size >= n. Tensors with the batch dim are copied into static
    buffers of P rows (rows n..P hold stale values), ints equal to the batch size become P, the
    graph captured for P replays, outputs are sliced back to n rows and inputs the region wrote
    in place are copied back: the caller sees eager's results.
  * graphs are captured lazily: the first `cudagraph_num_warmup` calls at P (at least one: lazy
    compiles and Triton autotuning cannot run under capture) run uncaptured through the same
    static buffers; the next call captures, then replays.

Inputs. Parameters and buffers (Dynamo marks them static) are read in place: their addresses are
baked into the graph (cudagraph_check_addresses verifies them on every replay). A user tensor
without the batch dim that the graph writes in place (a KV cache) is read in place too, and its
address is verified on every replay: a moved cache would otherwise be silently stale. Every other
tensor is copied into a static buffer, except when it already lives in the output of a graph
captured for the same size (the residual stream between pieces): then the graph reads it there.

Memory. One private pool per device, shared by every graph of the backend. All graphs of one
compiled graph capture a size during one forward call, in call order: an output that a later
piece reads is alive while the pieces in between are captured, so the allocator never gives its
memory to them. After capture, outputs are kept as non-owning tensors, so the graphs of other
sizes reuse that memory; outputs that leave the compiled graph stay owned, so a result survives
calls at other sizes (the next call at the same size overwrites it, as with reduce-overhead).

Padding assumes rows of the batch dim are computed independently (token-wise decoder compute). A
region that writes in place into a tensor without the batch dim (outside splitting ops) would
write padding rows into it, so such a region is only captured at exact capture sizes.
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
import operator
import re
import time
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx
import tqdm
from torch.multiprocessing.reductions import StorageWeakRef

from torch_ext import compat
from torch_ext.backend.config import CompileConfig
from torch_ext.backend.piecewise import CompiledPiece, batch_symbol
from torch_ext.backend.split import INLINABLE_HOPS, SplitGraph, hop_bodies, hop_name

log = logging.getLogger(__name__)

__all__ = [
    "CudaGraphAddressError",
    "CudaGraphBufferMutationError",
    "CudaGraphCaptureError",
    "CudaGraphError",
    "CudaGraphManager",
    "CudaGraphRunner",
    "capture_sizes",
    "cudagraph_stats",
    "padded_size",
]


class CudaGraphError(RuntimeError):
    """Base of the CUDA-graph errors torch_ext raises."""


class CudaGraphAddressError(CudaGraphError):
    """An input read in place by a captured graph is no longer where it was at capture."""


class CudaGraphCaptureError(CudaGraphError):
    """The region could not be captured (it synchronizes with the host, or uses the CPU)."""


class CudaGraphBufferMutationError(CudaGraphError):
    """A forward assigns or mutates module state that captured graphs read in place."""


@dataclasses.dataclass
class CudaGraphStats:
    captures: int = 0  # graphs captured
    replays: int = 0
    uncaptured_runs: int = 0  # calls that ran without a graph (warm-up, too large, not capturable)
    capture_seconds: float = 0.0  # wall time inside capture (warm-up runs not included)
    capture_bytes: int = 0  # growth of reserved device memory during captures: the pools
    static_input_bytes: int = 0  # static input buffers (outside the pools)
    sizes: set = dataclasses.field(default_factory=set)  # capture sizes with at least one graph

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)


cudagraph_stats = CudaGraphStats()


def padded_size(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest capture size >= n, or None when n is larger than all of them (sizes sorted)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


# --- what a graph writes in place -------------------------------------------------------------

_NOT_DATA_WRITES = {"requires_grad_", "share_memory_", "record_stream_", "retain_grad_"}
_INPLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
                      operator.ixor, operator.ilshift, operator.irshift, operator.imatmul}


def _written_args(node: fx.Node) -> list[Any]:
    """The arguments `node` writes in place (a conservative reading of a Dynamo-level node)."""
    written: list[Any] = []
    out = node.kwargs.get("out")
    if out is not None:
        written.extend(out if isinstance(out, (tuple, list)) else [out])
    if node.op == "call_method":
        name = node.target
        if name.endswith("_") and not name.endswith("__") and name not in _NOT_DATA_WRITES:
            written.append(node.args[0])
    elif node.op == "call_function":
        target = node.target
        if target in _INPLACE_OPERATORS:
            written.append(node.args[0])
        elif isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            overloads = [target] if isinstance(target, torch._ops.OpOverload) else \
                [getattr(target, name) for name in target.overloads()]
            for op in overloads:
                for i, arg in enumerate(op._schema.arguments):
                    if arg.alias_info is not None and arg.alias_info.is_write:
                        if i < len(node.args):
                            written.append(node.args[i])
                        elif arg.name in node.kwargs:
                            written.append(node.kwargs[arg.name])
        else:
            name = getattr(target, "__name__", "")
            if (name.endswith("_") and not name.endswith("__") and name not in _NOT_DATA_WRITES
                    and node.args) or node.kwargs.get("inplace") is True:
                written.append(node.args[0])
    return [w for w in written if isinstance(w, fx.Node)]


def _value(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _storage(value: Any):
    if isinstance(value, torch.Tensor):
        try:
            return StorageWeakRef(value.untyped_storage())  # views of one fake tensor share it
        except Exception:  # a tensor subclass without a storage
            return None
    return None


def written_placeholders(gm: fx.GraphModule, skip: Callable[[fx.Node], bool] | None = None) -> dict[int, fx.Node]:
    """Placeholders (by position) whose memory some node of gm writes in place, with that node.
    Views count (storage identity of the fake values); bodies of wrap-like HOPs are followed.
    `skip(node)` leaves chosen nodes out (the splitting ops)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_storage: dict[Any, list[int]] = {}
    for i, p in enumerate(placeholders):
        key = _storage(_value(p))
        if key is not None:
            by_storage.setdefault(key, []).append(i)
    found: dict[int, fx.Node] = {}

    def mark(target: fx.Node, writer: fx.Node) -> None:
        if target.op == "placeholder":
            found.setdefault(placeholders.index(target), writer)
            return
        for i in by_storage.get(_storage(_value(target)), ()):
            found.setdefault(i, writer)

    for node in gm.graph.nodes:
        if skip is not None and skip(node):
            continue
        for arg in _written_args(node):
            mark(arg, node)
        name = hop_name(node)
        if name in INLINABLE_HOPS:
            bodies = hop_bodies(gm, node)
            _, first = INLINABLE_HOPS[name]
            operands = node.args[first:]
            for body in bodies[:1]:
                for i in written_placeholders(body, skip):
                    if i < len(operands) and isinstance(operands[i], fx.Node):
                        mark(operands[i], node)
    return found


# --- the shapes of a region's inputs and outputs ----------------------------------------------

TENSOR, SCALAR, CONST = "tensor", "scalar", "const"
STATIC, PINNED, COPIED = "static", "pinned", "copied"


class _NotCapturable(Exception):
    pass


def _expr(x: Any, symbol) -> Any:
    """x (int or SymInt) as an int or a sympy expression of the batch symbol only."""
    if isinstance(x, torch.SymInt):
        expr = x.node.expr
        extra = expr.free_symbols - ({symbol} if symbol is not None else set())
        if extra:
            raise _NotCapturable(f"its shape depends on {sorted(map(str, extra))} besides the batch size")
        return int(expr) if not expr.free_symbols else expr
    if isinstance(x, int):
        return x
    raise _NotCapturable(f"it holds a symbolic {type(x).__name__}")


def _at(expr: Any, symbol, n: int) -> int:
    return expr if isinstance(expr, int) else int(expr.xreplace({symbol: n}))


@dataclasses.dataclass
class _Spec:
    kind: str  # TENSOR, SCALAR or CONST
    name: str = ""
    shape: tuple = ()  # ints and sympy expressions of the batch symbol
    stride: tuple = ()
    batch_dims: tuple[int, ...] = ()  # dims whose size is the batch size
    dtype: Any = None
    expr: Any = None  # SCALAR: sympy expression or int
    value: Any = None  # CONST
    role: str = COPIED  # tensor inputs: STATIC, PINNED or COPIED
    written: bool = False  # the region writes this input in place

    def shape_at(self, symbol, n: int) -> list[int]:
        return [_at(s, symbol, n) for s in self.shape]

    def stride_at(self, symbol, n: int) -> list[int]:
        return [_at(s, symbol, n) for s in self.stride]


def _spec(value: Any, symbol, name: str) -> _Spec:
    if isinstance(value, torch.Tensor):
        shape = tuple(_expr(s, symbol) for s in value.shape)
        stride = tuple(_expr(s, symbol) for s in value.stride())
        batch_dims = []
        for d, s in enumerate(shape):
            if isinstance(s, int):
                continue
            if s != symbol:
                raise _NotCapturable(f"dim {d} has size {s}: only dims of exactly the batch size can be padded")
            batch_dims.append(d)
        if any(isinstance(st, int) and st == 0 and not (isinstance(sz, int) and sz <= 1)
               for sz, st in zip(shape, stride)):
            raise _NotCapturable("it is an expanded tensor (stride 0)")
        return _Spec(TENSOR, name, shape, stride, tuple(batch_dims), value.dtype)
    if isinstance(value, torch.SymInt):
        return _Spec(SCALAR, name, expr=_expr(value, symbol))
    if isinstance(value, (torch.SymFloat, torch.SymBool)):
        raise _NotCapturable(f"{name} is a symbolic {type(value).__name__}")
    return _Spec(CONST, name, value=value)


# --- the runner ---------------------------------------------------------------------------------

WARMUP, CAPTURE, REPLAY = "warmup", "capture", "replay"


class _Group:
    """The runners of one compiled graph. They capture a size in one forward call, in call order:
    the leader (the first capturable runner) counts forward calls and decides when."""

    def __init__(self, manager: CudaGraphManager, name: str):
        self.manager = manager
        self.name = name
        self.runners: list[CudaGraphRunner] = []
        self.leader: CudaGraphRunner | None = None
        self.calls = 0  # forward calls, counted by the leader
        self.steps: dict[Any, int] = {}  # capture size -> calls at it that reached the leader's slow path
        self.capture_call: dict[Any, int] = {}  # capture size -> the call that captures it
        self._bars: dict[Any, Any] = {}

    def add(self, runner: CudaGraphRunner) -> None:
        self.runners.append(runner)
        # Exact-size-only runners lead only when alone: they skip padded calls, which others count on.
        if runner.capturable and (self.leader is None or (self.leader.exact_only and not runner.exact_only)):
            if self.leader is not None:
                self.leader.is_leader = False
            self.leader = runner
            runner.is_leader = True

    def phase(self, runner: CudaGraphRunner, size) -> str:
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

    def captured(self, size) -> None:
        total = sum(1 for r in self.runners if r.capturable)
        if total < 2:
            return
        bar = self._bars.get(size)
        if bar is None:
            bar = self._bars[size] = tqdm.tqdm(
                total=total, desc=f"torch_ext CUDA graphs {self.name} size={size}", unit="graph",
                leave=False, disable=self.manager.bar_disabled)
        bar.update(1)
        if bar.n >= bar.total:
            bar.close()


@dataclasses.dataclass
class _Entry:
    """What one runner holds for one capture size."""

    size: Any  # padded batch size (None for a graph without a dynamic dim)
    static_args: list  # what the wrapped callable gets: static buffers, in-place tensors, ints
    buffers: dict[int, torch.Tensor]  # own static buffers by input position
    graph: Any = None
    outputs: list | None = None  # static outputs (non-owning where nothing outside needs them)
    reused: dict[int, tuple[int, tuple]] = dataclasses.field(default_factory=dict)  # pos -> (ptr, stride)
    addresses: dict[int, int] = dataclasses.field(default_factory=dict)  # in-place inputs at capture
    captured_at: int | None = None  # the batch size of the capturing call


@dataclasses.dataclass
class _Plan:
    """A replay at one runtime batch size: everything precomputed so the call does little."""

    entry: _Entry
    graph: Any
    copies: list  # (pos, destination view of n rows)
    copy_back: list  # (pos, source view of n rows)
    reused: list  # [pos, ptr, stride, last tensor seen there]: read in place from an earlier graph's output
    pinned: list  # (pos, ptr): verified on every replay
    checked: list  # (pos, ptr or const): verified when cudagraph_check_addresses is on
    result: Any
    replay: Callable | None = None  # the graph's C++ replay, bound (skips CUDAGraph.replay's Python frame)


_NO_GRAPH = _Plan(None, None, [], [], [], [], [], None)  # type: ignore[arg-type]


class CudaGraphRunner:
    """One call site of a region (a compiled piece, or the whole split graph in "full" mode)."""

    def __init__(self, group: _Group, runnable: Callable, name: str, inputs: list[_Spec], outputs: list[_Spec],
                 symbol, single_output: bool, keep: set[int], exact_only: bool, reason: str | None):
        self.group = group
        self.manager = group.manager
        self.runnable = runnable
        self.name = name
        self.inputs = inputs
        self.outputs = outputs
        self.symbol = symbol
        self.single_output = single_output
        self.keep = keep  # outputs that leave the compiled graph: kept owned
        self.exact_only = exact_only  # writes into a tensor without the batch dim: never pad
        self.reason = reason  # why this region is never captured (None: it is)
        self.capturable = reason is None
        self.locator = None
        if self.capturable and symbol is not None:
            self.locator = _locate(inputs, symbol)
            if self.locator is None:
                self.capturable, self.reason = False, "no input carries the batch size"
        self._plans: dict[Any, _Plan] = {}
        self._entries: dict[Any, _Entry] = {}
        self._device: torch.device | None = None
        self._may_need_grad = any(s.kind == TENSOR for s in inputs)
        self.is_leader = False
        self.made_by_splitting_op: dict[int, str] = {}  # input position -> the splitting op that returned it
        group.add(self)

    def __repr__(self) -> str:
        return f"CudaGraphRunner({self.name})"

    def _size(self, args):
        if self.locator is None:
            return None
        i, d = self.locator
        return args[i] if d is None else args[i].shape[d]

    def __call__(self, *args):
        # The hot path of piecewise graphs (once per piece per step): keep it to a few lookups.
        if self.is_leader:
            self.group.calls += 1
        locator = self.locator
        if locator is None:
            plan = self._plans.get(None)
        else:
            i, d = locator
            plan = self._plans.get(args[i] if d is None else args[i].shape[d])
        if plan is None or plan.replay is None or (self._may_need_grad and torch.is_grad_enabled()):
            return self._slow(args, plan)
        return self._replay(plan, args)

    def _replay(self, plan: _Plan, args):
        for reused in plan.reused:
            a = args[reused[0]]
            if a is not reused[3]:  # the previous piece hands over the same result tensors each step
                if a.data_ptr() != reused[1] or a.stride() != reused[2]:
                    # Not the earlier graph's output this time: a copy into its memory could clobber it.
                    self.manager.note_once(("moved", self.name), "torch_ext: %s ran without its CUDA graph: "
                                           "input %d no longer lives in the output of the graph before it",
                                           self.name, reused[0])
                    return self._uncaptured(args)
                reused[3] = a
        for i, ptr in plan.pinned:
            if args[i].data_ptr() != ptr:
                raise self._moved_error(plan.entry, i, args[i], ptr)
        if plan.checked:
            self._check(plan, args)
        for i, dst in plan.copies:
            dst.copy_(args[i])
        plan.replay()
        for i, src in plan.copy_back:
            args[i].copy_(src)
        cudagraph_stats.replays += 1
        return plan.result

    def _uncaptured(self, args):
        cudagraph_stats.uncaptured_runs += 1
        return self.runnable(*args)

    def _slow(self, args, plan: _Plan | None):
        if not self.capturable:
            if self.reason is not None:
                self.manager.note_once(("never", self.name), "torch_ext: %s runs without CUDA graphs: %s",
                                       self.name, self.reason)
            return self._uncaptured(args)
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            self.manager.note_once(("grad",), "torch_ext: CUDA graphs are skipped for calls that record autograd "
                                   "(run under torch.no_grad() or torch.inference_mode() to use them)")
            return self._uncaptured(args)
        if plan is not None:
            return self._uncaptured(args) if plan.replay is None else self._replay(plan, args)
        if self._device is None and not self._check_device(args):
            return self._uncaptured(args)
        n = self._size(args)
        n = int(n) if n is not None else None
        size = self.manager.capture_size(n) if self.symbol is not None else None
        if self.symbol is not None and (size is None or (self.exact_only and size != n)):
            self._plans[n] = _NO_GRAPH
            return self._uncaptured(args)
        entry = self._entries.get(size)
        if entry is None:
            entry = self._entries[size] = self._new_entry(size, args)
        if entry.graph is not None:
            plan = self._plans[n] = self._plan(entry, n)
            return self._replay(plan, args)
        phase = self.group.phase(self, size)
        if phase == CAPTURE:
            return self._capture(entry, n, args)
        if phase == REPLAY:  # missed its group's capture call: capturing now could reuse live memory
            self.manager.note_once(("missed", self.name, size), "torch_ext: %s runs without a CUDA graph at size "
                                   "%s (it was not called in its graph's capturing forward)", self.name, size)
        cudagraph_stats.uncaptured_runs += 1
        return self._run_padded(entry, n, args)

    def _check_device(self, args) -> bool:
        devices = {a.device for a in args if isinstance(a, torch.Tensor)}
        if len(devices) != 1 or not self.manager.can_capture_on(next(iter(devices))):
            self.capturable, self.reason = False, f"its inputs are on {sorted(map(str, devices))}, not one CUDA device"
            self.manager.warn_cpu_once()
            return False
        self._device = next(iter(devices))
        return True

    # -- static buffers, plans ------------------------------------------------------------------

    def _new_entry(self, size, args) -> _Entry:
        static_args = list(args)
        buffers: dict[int, torch.Tensor] = {}
        for i, spec in enumerate(self.inputs):
            if spec.kind == SCALAR:
                static_args[i] = _at(spec.expr, self.symbol, size) if self.symbol is not None else args[i]
            elif spec.kind == TENSOR and spec.role == COPIED:
                buf = torch.empty_strided(spec.shape_at(self.symbol, size), spec.stride_at(self.symbol, size),
                                          dtype=spec.dtype, device=args[i].device)
                cudagraph_stats.static_input_bytes += buf.untyped_storage().nbytes()
                buffers[i] = static_args[i] = buf
        return _Entry(size, static_args, buffers)

    def _rows(self, t: torch.Tensor, spec: _Spec, n) -> torch.Tensor:
        for d in spec.batch_dims:
            t = t.narrow(d, 0, n)
        return t

    def _fill(self, entry: _Entry, n, args) -> list:
        """Copy the copied inputs into the entry's buffers; returns (pos, view) of the written ones."""
        back = []
        for i, buf in entry.buffers.items():
            view = self._rows(buf, self.inputs[i], n)
            view.copy_(args[i])
            if self.inputs[i].written:
                back.append((i, view))
        return back

    def _result(self, outs: list, n):
        values = []
        for spec, out in zip(self.outputs, outs):
            if spec.kind == TENSOR and isinstance(out, torch.Tensor):
                values.append(self._rows(out, spec, n))
            elif spec.kind == SCALAR and self.symbol is not None:
                values.append(_at(spec.expr, self.symbol, n))
            else:
                values.append(out)
        return values[0] if self.single_output else tuple(values)

    def _outputs(self, out) -> list:
        return [out] if self.single_output else list(out)

    def _run_padded(self, entry: _Entry, n, args):
        back = self._fill(entry, n, args)
        out = self._outputs(self.runnable(*entry.static_args))
        for i, view in back:
            args[i].copy_(view)
        return self._result(out, n)

    def _plan(self, entry: _Entry, n) -> _Plan:
        copies, copy_back = [], []
        for i, buf in entry.buffers.items():
            view = self._rows(buf, self.inputs[i], n)
            copies.append((i, view))
            if self.inputs[i].written:
                copy_back.append((i, view))
        reused = [[i, ptr, stride, None] for i, (ptr, stride) in entry.reused.items()]
        pinned = [(i, entry.addresses[i]) for i, s in enumerate(self.inputs) if s.kind == TENSOR and s.role == PINNED]
        checked = []
        if self.manager.check_addresses:
            checked = [(i, entry.addresses[i]) for i, s in enumerate(self.inputs) if s.kind == TENSOR and s.role == STATIC]
            checked += [(i, s.value) for i, s in enumerate(self.inputs) if s.kind == CONST]
        return _Plan(entry, entry.graph, copies, copy_back, reused, pinned, checked, self._result(entry.outputs, n),
                     _replayer(entry.graph))

    # -- capture ----------------------------------------------------------------------------------

    def _capture(self, entry: _Entry, n, args):
        for i, spec in enumerate(self.inputs):
            if spec.kind != TENSOR:
                continue
            if spec.role == COPIED and self.symbol is not None:
                padded = self.manager.output_view(args[i], entry.size, spec.shape_at(self.symbol, entry.size))
                if padded is not None:  # read in place from an earlier graph's output
                    entry.static_args[i] = _non_owning(padded)  # that graph's memory, not ours to keep
                    entry.reused[i] = (args[i].data_ptr(), args[i].stride())
                    buf = entry.buffers.pop(i)
                    cudagraph_stats.static_input_bytes -= buf.untyped_storage().nbytes()
            elif spec.role != COPIED:
                entry.static_args[i] = args[i]
                entry.addresses[i] = args[i].data_ptr()
        copied = [(i, self.made_by_splitting_op[i]) for i in entry.buffers if i in self.made_by_splitting_op]
        if copied:
            self.manager.note_once(
                ("copied", self.name), "torch_ext: %s copies %s into static buffers on every replay (%d bytes at "
                "batch size %s): the splitting op allocates its result. A splitting op that writes into a buffer "
                "the model allocates before the call (torch.empty_like, listed in mutates_args) leaves it in the "
                "graph before, where the graph after reads it without a copy (README: CUDA graphs).", self.name,
                ", ".join(f"input {i} '{self.inputs[i].name}' (from {op})" for i, op in copied),
                sum(entry.buffers[i].untyped_storage().nbytes() for i, _ in copied), entry.size)
        back = self._fill(entry, n, args)
        try:
            graph, out = self.manager.capture(self.runnable, entry.static_args, self._device, self.name, entry.size)
        except Exception as e:  # its static inputs are half set up: never capture this region again
            self.capturable, self.reason = False, f"capture failed ({type(e).__name__})"
            raise
        outs = self._outputs(out)
        entry.graph, entry.captured_at = graph, n
        self.manager.note_outputs(outs, entry.size)
        entry.outputs = [o if k in self.keep or not isinstance(o, torch.Tensor) else _non_owning(o)
                         for k, o in enumerate(outs)]
        graph.replay()  # capture records without running: this call's results come from a replay
        for i, view in back:
            args[i].copy_(view)
        self._plans = {k: p for k, p in self._plans.items() if p.entry is not entry}
        self.group.captured(entry.size)
        # Owned outputs for this call: the memory stays taken until the forward is done with it.
        return self._result(outs, n)

    # -- errors -----------------------------------------------------------------------------------

    def _moved_error(self, entry: _Entry, i: int, arg: torch.Tensor, ptr: int) -> CudaGraphAddressError:
        spec = self.inputs[i]
        why = ("a parameter or buffer (or a tensor marked with torch._dynamo.mark_static_address)"
               if spec.role == STATIC else "a tensor without the batch dim that the graph writes in place")
        return CudaGraphAddressError(
            f"torch_ext CUDA graph of {self.name} (capture size {entry.size}, captured at batch size "
            f"{entry.captured_at}): input {i} '{spec.name}' was at 0x{ptr:x} when the graph was captured and is "
            f"now at 0x{arg.data_ptr():x}. It is {why}, so the graph reads it in place, from the address it "
            "had at capture. Keep such tensors where they are between calls: update them in place (copy_, "
            "index_copy_) instead of assigning new tensors, or run with cudagraph_mode='none'.")

    def _check(self, plan: _Plan, args) -> None:
        for i, expected in plan.checked:
            spec = self.inputs[i]
            if spec.kind == CONST:
                if args[i] != expected:
                    raise CudaGraphAddressError(
                        f"torch_ext CUDA graph of {self.name}: argument {i} '{spec.name}' was {expected!r} at "
                        f"capture and is {args[i]!r} now; the graph holds the captured value. (With "
                        "guard_free_dispatch, Dynamo does not re-check such values.)")
            elif args[i].data_ptr() != expected:
                raise self._moved_error(plan.entry, i, args[i], expected)


def _locate(inputs: list[_Spec], symbol) -> tuple[int, int | None] | None:
    """Where a call's batch size can be read: an int input equal to it (cheapest), else a batch dim."""
    for i, spec in enumerate(inputs):
        if spec.kind == SCALAR and not isinstance(spec.expr, int) and spec.expr == symbol:
            return (i, None)
    for i, spec in enumerate(inputs):
        if spec.kind == TENSOR and spec.batch_dims:
            return (i, spec.batch_dims[0])
    return None


def _replayer(graph) -> Callable:
    """graph.replay, bound to the C++ method when graph is a CUDAGraph (its Python override only
    calls super())."""
    base = getattr(torch._C, "_CUDAGraph", None)
    if base is not None and isinstance(graph, base):
        return base.replay.__get__(graph)
    return graph.replay


def _non_owning(t: torch.Tensor) -> torch.Tensor:
    """A tensor over t's memory that does not keep it allocated (the pool may reuse it)."""
    storage = t.untyped_storage()
    weak = compat.non_owning_storage(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(weak, t.storage_offset(), t.shape, t.stride())


# --- the manager: one per backend -------------------------------------------------------------

_STATIC_NAME = re.compile(r"(^|_)(buffers|parameters)_")


@dataclasses.dataclass
class GraphInfo:
    """What `prepare` learnt from the Dynamo graph, for `wrap`."""

    name: str
    symbol: Any
    placeholders: dict[str, tuple[Any, bool, bool, bool]]  # name -> (value, static, written, written by non-splitting op)
    outputs: list[Any]


class CudaGraphManager:
    """CUDA graphs for one backend (one CompileConfig): the memory pools, warnings, capture."""

    def __init__(self, config: CompileConfig):
        self.config = config
        self.mode = config.cudagraph_mode
        self.sizes = tuple(config.cudagraph_capture_sizes)
        self.num_warmup = max(1, config.cudagraph_num_warmup)
        self.check_addresses = config.cudagraph_check_addresses
        self.bar_disabled = {True: False, False: True, None: None}[config.progress_bar]
        self._pools: dict[Any, Any] = {}
        self._streams: dict[Any, Any] = {}
        self._output_storages: dict[int, Any] = {}  # storage address -> capture size of the graph writing it
        self._noted: set = set()
        self.groups: list[_Group] = []  # one per compiled graph, for inspection
        padded_away = [n for n in config.compile_sizes if self.sizes and n < self.sizes[-1] and n not in self.sizes]
        if padded_away:
            log.warning("torch_ext: compile_sizes %s are not cudagraph_capture_sizes: a call at such a batch size is "
                        "padded to the next capture size before the pieces run, so these compiles serve only calls "
                        "that run without CUDA graphs (recording autograd, regions that cannot be captured, no "
                        "CUDA). Add them to cudagraph_capture_sizes, or drop them.", list(padded_away))

    def graphs_available(self) -> bool:
        return torch.cuda.is_available()

    def can_capture_on(self, device: torch.device) -> bool:
        return device.type == "cuda" and self.graphs_available()

    def runners(self) -> list[CudaGraphRunner]:
        return [r for g in self.groups for r in g.runners]

    def capture_size(self, n: int | None):
        if n is None or n < 1:
            return None
        return padded_size(n, self.sizes)

    def note_once(self, key, msg: str, *args) -> None:
        if key not in self._noted:
            self._noted.add(key)
            log.info(msg, *args)

    def warn_cpu_once(self) -> None:
        if ("cpu",) not in self._noted:
            self._noted.add(("cpu",))
            warnings.warn(f"torch_ext: cudagraph_mode={self.mode!r} but the inputs are not on a CUDA device "
                          "(or CUDA is unavailable): the compiled pieces run without CUDA graphs.", stacklevel=3)

    # -- analysis of the Dynamo graph ---------------------------------------------------------------

    def prepare(self, gm: fx.GraphModule, is_splitting: Callable[[fx.Node], bool], name: str) -> GraphInfo:
        """Read the Dynamo graph (after HOP inlining); refuse module state mutated outside splitting ops,
        and have the frame's transformed code checked for module state assignments."""
        written = written_placeholders(gm)
        written_outside = written_placeholders(gm, skip=is_splitting)
        placeholders = {}
        for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
            static = "_dynamo_static_input_type" in node.meta.get("tensor_dict", {})
            placeholders[node.name] = (_value(node), static, i in written, i in written_outside)
            if static and i in written_outside and _STATIC_NAME.search(node.name.lower()):
                raise _mutation_error(node, written_outside[i])
        from torch_ext.backend import dispatch  # it imports this module

        dispatch.expect_transformed_code(f"cudagraph_mode={self.mode!r}")
        output = gm.graph.output_node().args[0]
        outputs = [_value(o) if isinstance(o, fx.Node) else o
                   for o in (output if isinstance(output, (tuple, list)) else (output,))]
        return GraphInfo(name, batch_symbol(gm), placeholders, outputs)

    # -- wrapping -------------------------------------------------------------------------------

    def wrap(self, split: SplitGraph, info: GraphInfo) -> Callable:
        """Put runners in: around each top-level compiled piece ("piecewise"), or around the whole
        split graph ("full", returned). HOP bodies split in_body mode run without graphs."""
        group = _Group(self, info.name)
        self.groups.append(group)
        if not self.graphs_available():
            self.warn_cpu_once()
        split_gm = split.split_gm
        if self.mode == "full":
            nodes = [n for n in split_gm.graph.nodes if n.op == "placeholder"]
            inputs, reason = self._input_specs(nodes, [_value(n) for n in nodes], info, None)
            outputs, out_reason = self._output_specs(info.outputs, info.symbol)
            # Writes by splitting ops are theirs to make padding-safe (the full-mode contract).
            exact = any(info.placeholders.get(n.name, (None,) * 4)[3] and not spec.batch_dims
                        for n, spec in zip(nodes, inputs) if spec.kind == TENSOR)
            return CudaGraphRunner(group, split_gm, f"{info.name} (full graph)", inputs, outputs, info.symbol,
                                   False, set(range(len(outputs))), exact, reason or out_reason)
        if any(p.kind == "hop" for p in split.pieces):
            self.note_once(("in_body",), "torch_ext: pieces inside HOP bodies split in_body run without CUDA "
                           "graphs (a body is shared by its call sites); hop_split='inline' captures them")
        for node in list(split_gm.graph.nodes):
            if node.op != "call_module":
                continue
            piece = split_gm.__dict__.get(node.target)
            if not isinstance(piece, CompiledPiece):
                sub = split_gm._modules.get(node.target)
                if isinstance(sub, fx.GraphModule):
                    self._note_slow_splitting_ops(sub)
                    # A splitting op's partition runs eagerly between two replays, on the critical
                    # path: call its code without nn.Module.__call__ (no hooks on these partitions).
                    split_gm.__dict__[node.target] = sub.forward
                continue
            written = written_placeholders(piece.graph_module)
            inputs, reason = self._input_specs(list(node.args), piece.example_inputs, info, written)
            out_node = piece.graph_module.graph.output_node().args[0]
            outputs, out_reason = self._output_specs([_value(o) if isinstance(o, fx.Node) else o for o in out_node],
                                                     info.symbol)
            exact = any(i in written and not s.batch_dims for i, s in enumerate(inputs) if s.kind == TENSOR)
            runner = CudaGraphRunner(group, piece, f"{info.name}/{node.target}", inputs, outputs, info.symbol,
                                     piece.single_output, _escaping(split_gm, node), exact, reason or out_reason)
            runner.made_by_splitting_op = _made_by_splitting_op(split_gm, node)
            split_gm.__dict__[node.target] = runner
        return split_gm

    def _note_slow_splitting_ops(self, partition: fx.GraphModule) -> None:
        for qualname in _ops_called(partition):
            if compat.is_python_custom_op(qualname):
                self.note_once(
                    ("custom_op", qualname), "torch_ext: splitting op %s is a torch.library.custom_op: outside "
                    "torch.inference_mode() its Python dispatch layers add 14-23 us of host time per call "
                    "(bench/splitting_op_cost.py), paid between the graphs on every step. For serving, declare "
                    "it with torch_ext.hops.splitting_op.splitting_op(..., autograd=False) or run under "
                    "torch.inference_mode().", qualname)

    def _input_specs(self, arg_nodes: list, values: list, info: GraphInfo, written: dict | None):
        """Specs of a region's inputs; `written` = inputs the region writes (None: the whole graph)."""
        specs = []
        try:
            for i, (node, value) in enumerate(zip(arg_nodes, values)):
                name = node.name if isinstance(node, fx.Node) else repr(node)
                spec = _spec(value, info.symbol, name)
                top = info.placeholders.get(name) if isinstance(node, fx.Node) and node.op == "placeholder" else None
                spec.written = bool(top and top[2]) if written is None else i in written
                if spec.kind == TENSOR and not spec.batch_dims and top is not None:
                    if top[1]:
                        spec.role = STATIC
                    elif spec.written:
                        spec.role = PINNED  # copying a KV cache in and out on every call would cost its size twice
                spec.written = spec.written and spec.role == COPIED  # copied back after each run
                specs.append(spec)
        except _NotCapturable as e:
            return [], f"input {name!r}: {e}"
        return specs, None

    def _output_specs(self, values: list, symbol):
        try:
            return [_spec(v, symbol, f"output {k}") for k, v in enumerate(values)], None
        except _NotCapturable as e:
            return [], f"an output: {e}"

    # -- memory and capture ---------------------------------------------------------------------

    def note_outputs(self, outs: list, size) -> None:
        for o in outs:
            if isinstance(o, torch.Tensor):
                self._output_storages[o.untyped_storage().data_ptr()] = size

    def output_view(self, arg: torch.Tensor, size, padded_shape: list[int]) -> torch.Tensor | None:
        """If arg lives in the output of a graph captured for `size`, the same view of it with the
        padded shape (what a graph of this size reads), else None."""
        storage = arg.untyped_storage()
        if self._output_storages.get(storage.data_ptr()) != size:
            return None
        if list(arg.shape) == padded_shape:
            return arg
        end = arg.storage_offset() + sum((s - 1) * st for s, st in zip(padded_shape, arg.stride())) + 1
        if min(padded_shape, default=1) < 1 or end * arg.element_size() > storage.nbytes():
            return None
        return arg.as_strided(padded_shape, arg.stride(), arg.storage_offset())

    def capture(self, fn: Callable, args: list, device: torch.device, name: str, size):
        label = f"{name} at batch size {size}"
        pool = self._pools.get(device)
        if pool is None:
            with torch.cuda.device(device):
                pool = self._pools[device] = torch.cuda.graph_pool_handle()
                self._streams[device] = torch.cuda.Stream(device)
        stream = self._streams[device]
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_reserved(device)
        start = time.perf_counter()
        stream.wait_stream(torch.cuda.current_stream(device))
        try:
            with torch.cuda.device(device), torch.cuda.stream(stream):
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    out = fn(*args)
                finally:
                    graph.capture_end()
        except Exception as e:
            raise CudaGraphCaptureError(
                f"torch_ext could not capture a CUDA graph of {label}: {type(e).__name__}: {e}\n"
                "Captured code must stay on the GPU: no .item()/.tolist()/print of tensor values, no CPU "
                "tensors, no host synchronization. Make such an op a splitting op (it then runs between "
                "graphs in cudagraph_mode='piecewise'), or use cudagraph_mode='none'.") from e
        torch.cuda.current_stream(device).wait_stream(stream)
        elapsed = time.perf_counter() - start
        grown = torch.cuda.memory_reserved(device) - before
        cudagraph_stats.captures += 1
        cudagraph_stats.capture_seconds += elapsed
        cudagraph_stats.capture_bytes += max(grown, 0)
        cudagraph_stats.sizes.add(size)
        log.debug("torch_ext: captured %s in %.1f ms (+%d bytes reserved)", label, elapsed * 1e3, grown)
        return graph, out


def _made_by_splitting_op(split_gm: fx.GraphModule, node: fx.Node) -> dict[int, str]:
    """Inputs of a piece's call that a splitting op's partition returned, with that op's name."""
    made = {}
    for i, arg in enumerate(node.args):
        source = arg.args[0] if isinstance(arg, fx.Node) and arg.target is operator.getitem else arg
        if not (isinstance(source, fx.Node) and source.op == "call_module"):
            continue
        sub = split_gm._modules.get(source.target)
        if isinstance(sub, fx.GraphModule) and not isinstance(split_gm.__dict__.get(source.target),
                                                              (CompiledPiece, CudaGraphRunner)):
            ops = _ops_called(sub)
            made[i] = ops[0] if ops else source.target
    return made


def _ops_called(gm: fx.GraphModule) -> list[str]:
    """Names ("ns::name") of the operators a graph calls, in order."""
    ops = [n.target for n in gm.graph.nodes if isinstance(n.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))]
    return [op.name().split(".")[0] if isinstance(op, torch._ops.OpOverload) else op._qualified_op_name for op in ops]


def _escaping(split_gm: fx.GraphModule, node: fx.Node) -> set[int]:
    """Outputs of a piece call that the split graph returns to its caller."""
    output = split_gm.graph.output_node()
    keep = set()
    if output in node.users:
        keep.add(0)
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and output in user.users:
            keep.add(user.args[1])
    return keep


def _mutation_error(placeholder: fx.Node, writer: fx.Node) -> CudaGraphBufferMutationError:
    trace = (writer.meta.get("stack_trace") or "").rstrip() or "  (no source location recorded)"
    kind = "parameter" if "parameters_" in placeholder.name.lower() else "buffer"
    return CudaGraphBufferMutationError(
        f"torch_ext: with CUDA graphs on, the forward mutates the module {kind} '{placeholder.name}' in place "
        f"outside a splitting op:\n    {writer.format_node()}\nat:\n{trace}\n"
        f"Captured graphs run at padded batch sizes, so an in-place update of module state inside them is "
        f"silently wrong (it sees the padding rows). Do the update in a splitting op (it runs eagerly, at the "
        f"real batch size), pass the tensor as an argument, or use cudagraph_mode='none'.")


def capture_sizes(step: Callable[[int], Any], config: CompileConfig) -> None:
    """Warm up and capture every size of config.cudagraph_capture_sizes by calling step(size)
    (which runs one forward at that batch size) enough times; largest size first, so the smaller
    sizes' graphs reuse the pool memory of the larger ones. Shows a tqdm bar."""
    sizes = sorted(config.cudagraph_capture_sizes, reverse=True)
    calls = max(1, config.cudagraph_num_warmup) + 1
    disable = {True: False, False: True, None: None}[config.progress_bar]
    for size in tqdm.tqdm(sizes, desc="torch_ext capturing CUDA graphs", unit="size", disable=disable):
        for _ in range(calls):
            step(size)
