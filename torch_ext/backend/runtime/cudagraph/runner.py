"""Capture and replay of one region (a compiled piece, or a whole split graph) per capture size.

`CudaGraphRunner` owns a region's static buffers and graphs; its `__call__` is the hot path of a
replay. The runners of one compiled graph form a `RunnerGroup` that captures a size in one forward
call (group.py); what it holds per capture size and batch size is in plan.py. The shared pool,
capture itself and the warnings live in the manager (manager.py).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from torch_ext import compat
from torch_ext.backend.runtime.cudagraph.errors import CudaGraphAddressError, CudaGraphCaptureError
from torch_ext.backend.runtime.cudagraph.group import CAPTURE, REPLAY, GraphKey, RunnerGroup
from torch_ext.backend.runtime.cudagraph.padding import (CONST, COPIED, PINNED, SCALAR, STATIC, TENSOR, Spec,
                                                        locate_batch_size, non_owning, one_row, size_at)
from torch_ext.backend.runtime.cudagraph.plan import NO_GRAPH, Entry, Plan, moved_input
from torch_ext.backend.runtime.cudagraph.stats import cudagraph_stats
from torch_ext.kernels.launch_policy import launched_from_host


class CudaGraphRunner:
    """One call site of a region (a compiled piece, or the whole split graph in "full" mode)."""

    def __init__(self, group: RunnerGroup, runnable: Callable, name: str, inputs: list[Spec], outputs: list[Spec],
                 symbol, single_output: bool, keep: set[int], exact_only: bool, reason: str | None,
                 max_size: int | None = None, fallback: Callable | None = None):
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
        self.max_size = max_size  # capture sizes above it are not this runner's ("full_and_piecewise")
        # What runs a call this runner does not replay (None: `runnable` without a graph). In
        # "full_and_piecewise" mode the full graph's runner falls back to the piecewise graphs.
        self.fallback = fallback
        self.locator = None
        if self.capturable and symbol is not None:
            self.locator = locate_batch_size(inputs, symbol)
            if self.locator is None:
                self.capturable, self.reason = False, "no input carries the batch size"
        self._plans: dict[Any, Plan] = {}  # batch size -> plan, of the weight set self._plans_weights
        self._plans_by_weights: dict[int, dict[Any, Plan]] = {0: self._plans}
        self._plans_weights = 0
        self._entries: dict[GraphKey, Entry] = {}
        self._device: torch.device | None = None
        self._retired: list[Entry] = []  # entries replaced by a re-capture (_moved), until it is done
        self._may_need_grad = any(s.kind == TENSOR for s in inputs)
        # Inputs written in place that carry the batch dim (a KV cache per batch size): read where they
        # are by the graph of a call at exactly a capture size; a padded call copies them (group.key).
        self.pins_rows = any(s.kind == TENSOR and s.role == PINNED and s.batch_dims for s in inputs)
        self.is_leader = False
        self.made_by_splitting_op: dict[int, str] = {}  # input position -> the splitting op that returned it
        # Parameters and buffers, read in place (unless cudagraph_check_addresses makes a move an
        # error): as the group's leader, their addresses name the call's weight set.
        self._weight_positions = [] if self.manager.check_addresses else [
            i for i, s in enumerate(inputs) if s.kind == TENSOR and s.role == STATIC]
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
        if (plan is None or plan.replay is None or plan.weights != self.group.weights
                or (self._may_need_grad and torch.is_grad_enabled())):
            return self._slow(args, plan)
        return self._replay(plan, args)

    def _replay(self, plan: Plan, args):
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
        moved = moved_input(plan, args)
        if moved is not None:
            return self._moved(plan.entry, *moved, args)
        if plan.checked:
            self._check(plan, args)
        for i, dst, dims in plan.expanded:
            src = one_row(args[i], dims)
            if src is None:
                return self._not_expanded(i, args)
            dst.copy_(src)
        for i, dst in plan.copies:
            dst.copy_(args[i])
        plan.replay()
        for i, src in plan.copy_back:
            args[i].copy_(src)
        cudagraph_stats.replays += 1
        return plan.result

    def _not_expanded(self, i: int, args):
        self.manager.note_once(("expanded", self.name, i), "torch_ext: %s runs without its CUDA graph for calls whose "
                               "input %d '%s' is not repeated (stride 0) along dims %s as when it was compiled",
                               self.name, i, self.inputs[i].name, list(self.inputs[i].expanded))
        return self._uncaptured(args)

    def _uncaptured(self, args):
        if self.fallback is not None:
            return self.fallback(*args)
        cudagraph_stats.uncaptured_runs += 1
        if not self.manager.reference_ops:
            return self.runnable(*args)
        with launched_from_host(self.manager.reference_ops):
            return self.runnable(*args)

    def _slow(self, args, plan: Plan | None):
        if not self.capturable:
            if self.reason is not None:
                self.manager.note_once(("never", self.name), "torch_ext: %s runs without CUDA graphs: %s",
                                       self.name, self.reason)
            return self._uncaptured(args)
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            self.manager.note_once(("grad",), "torch_ext: CUDA graphs are skipped for calls that record autograd "
                                   "(run under torch.no_grad() or torch.inference_mode() to use them)")
            return self._uncaptured(args)
        if plan is None and self.is_leader and self._weight_positions:  # the leader names the call's set
            self.group.choose_weights([args[i] for i in self._weight_positions])
        if self.group.weights != self._plans_weights:  # another layer's weights: their plans
            plan = self._follow_weights(args)
        if plan is not None:
            return self._uncaptured(args) if plan.replay is None else self._replay(plan, args)
        if self._device is None and not self._check_device(args):
            return self._uncaptured(args)
        n = self._size(args)
        n = int(n) if n is not None else None
        size = self.manager.capture_size(n, self.max_size) if self.symbol is not None else None
        if self.symbol is not None and (size is None or (self.exact_only and size != n)):
            self._plans[n] = NO_GRAPH
            return self._uncaptured(args)
        key = self.group.key(size, n)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = self._new_entry(size, key, args)
        if entry.graph is not None:
            plan = self._plans[n] = self._plan(entry, n)
            return self._replay(plan, args)
        phase = self.group.phase(self, key)
        if phase == CAPTURE:
            return self._capture(entry, n, args)
        if phase == REPLAY:  # missed its group's capture call: capturing now could reuse live memory
            self.manager.note_once(("missed", self.name, size), "torch_ext: %s runs without a CUDA graph at size "
                                   "%s (it was not called in its graph's capturing forward)", self.name, size)
        cudagraph_stats.uncaptured_runs += 1
        return self._run_padded(entry, n, args)

    def _follow_weights(self, args) -> Plan | None:
        """Switch to the plans of the group's weight set; the plan of this call's batch size, if any."""
        ws = self._plans_weights = self.group.weights
        self._plans = self._plans_by_weights.setdefault(ws, {})
        return self._plans.get(self._size(args))

    def drop_weights(self, ws: int) -> None:
        """Drop the graphs of weight set `ws` (RunnerGroup.choose_weights: its tensors are gone)."""
        for key in [k for k in self._entries if k.weights == ws]:
            self._retire(key)
        if ws != self._plans_weights:
            self._plans_by_weights.pop(ws, None)

    def _check_device(self, args) -> bool:
        devices = {a.device for a in args if isinstance(a, torch.Tensor)}
        if len(devices) != 1 or not self.manager.can_capture_on(next(iter(devices))):
            self.capturable, self.reason = False, f"its inputs are on {sorted(map(str, devices))}, not one CUDA device"
            self.manager.warn_cpu_once()
            return False
        self._device = next(iter(devices))
        return True

    # -- static buffers, plans ------------------------------------------------------------------

    def _new_entry(self, size, key, args) -> Entry:
        static_args = list(args)
        buffers: dict[int, torch.Tensor] = {}
        copy_back: set[int] = set()
        padded = key.padded
        for i, spec in enumerate(self.inputs):
            if spec.kind == SCALAR:
                static_args[i] = size_at(spec.expr, self.symbol, size) if self.symbol is not None else args[i]
            elif spec.kind == TENSOR and (spec.role == COPIED or (padded and spec.role == PINNED and spec.batch_dims)):
                # A pinned input with the batch dim has n rows where the graph reads P: copied in and out.
                buf = torch.empty_strided(spec.shape_at(self.symbol, size), spec.stride_at(self.symbol, size),
                                          dtype=spec.dtype, device=args[i].device)
                cudagraph_stats.static_input_bytes += buf.untyped_storage().nbytes()
                buffers[i] = static_args[i] = buf
                if spec.written or spec.role == PINNED:
                    copy_back.add(i)
        return Entry(size, key, static_args, buffers, copy_back)

    def _rows(self, t: torch.Tensor, spec: Spec, n) -> torch.Tensor:
        for d in spec.batch_dims:
            t = t.narrow(d, 0, n)
        return t

    def _fill(self, entry: Entry, n, args) -> list:
        """Copy the copied inputs into the entry's buffers; returns (pos, view) of the written ones."""
        back = []
        for i, buf in entry.buffers.items():
            view = self._rows(buf, self.inputs[i], n)
            dims = self.inputs[i].expanded
            if dims:  # checked by the caller (_expanded_as_compiled)
                one_row(view, dims).copy_(one_row(args[i], dims))
            else:
                view.copy_(args[i])
            if i in entry.copy_back:
                back.append((i, view))
        return back

    def _expanded_as_compiled(self, args) -> int | None:
        """The first copied input that is not repeated along its Spec.expanded dims, else None."""
        for i, spec in enumerate(self.inputs):
            if spec.expanded and spec.role == COPIED and one_row(args[i], spec.expanded) is None:
                return i
        return None

    def _result(self, outs: list, n):
        values = []
        for spec, out in zip(self.outputs, outs):
            if spec.kind == TENSOR and isinstance(out, torch.Tensor):
                values.append(self._rows(out, spec, n))
            elif spec.kind == SCALAR and self.symbol is not None:
                values.append(size_at(spec.expr, self.symbol, n))
            else:
                values.append(out)
        return values[0] if self.single_output else tuple(values)

    def _outputs(self, out) -> list:
        return [out] if self.single_output else list(out)

    def _run_padded(self, entry: Entry, n, args):
        if (differs := self._expanded_as_compiled(args)) is not None:
            return self._not_expanded(differs, args)
        back = self._fill(entry, n, args)
        out = self._outputs(self.runnable(*entry.static_args))
        for i, view in back:
            args[i].copy_(view)
        return self._result(out, n)

    def _plan(self, entry: Entry, n) -> Plan:
        copies, copy_back, expanded = [], [], []
        for i, buf in entry.buffers.items():
            view = self._rows(buf, self.inputs[i], n)
            dims = self.inputs[i].expanded
            if dims:
                expanded.append((i, one_row(view, dims), dims))
            else:
                copies.append((i, view))
            if i in entry.copy_back:
                copy_back.append((i, view))
        reused = [[i, ptr, stride, None] for i, (ptr, stride) in entry.reused.items()]
        # Parameters and buffers too: `load_state_dict(assign=True)` or `.data = t` moves them, and the
        # graph would read the old memory. A move captures again; cudagraph_check_addresses makes it an error.
        strict = self.manager.check_addresses
        pinned = [(i, entry.addresses[i]) for i, s in enumerate(self.inputs) if s.kind == TENSOR and i not in
                  entry.buffers and (s.role == PINNED or (s.role == STATIC and not strict))]
        checked = []
        if strict:
            checked = [(i, entry.addresses[i]) for i, s in enumerate(self.inputs) if s.kind == TENSOR and s.role == STATIC]
            checked += [(i, s.value) for i, s in enumerate(self.inputs) if s.kind == CONST]
        return Plan(entry, entry.graph, copies, copy_back, reused, pinned, checked, self._result(entry.outputs, n),
                     _replayer(entry.graph), *compat.address_check(pinned, len(self.inputs)), weights=entry.key.weights,
                     expanded=expanded)

    # -- capture ----------------------------------------------------------------------------------

    def _capture(self, entry: Entry, n, args):
        if (differs := self._expanded_as_compiled(args)) is not None:
            return self._not_expanded(differs, args)
        for i, spec in enumerate(self.inputs):
            if spec.kind != TENSOR:
                continue
            if spec.role == COPIED:
                padded = self.manager.output_view(args[i], entry.key, spec.shape_at(self.symbol, entry.size))
                if padded is not None:  # read in place from an earlier graph's output
                    entry.static_args[i] = non_owning(padded)  # that graph's memory, not ours to keep
                    entry.reused[i] = (args[i].data_ptr(), args[i].stride())
                    buf = entry.buffers.pop(i)
                    cudagraph_stats.static_input_bytes -= buf.untyped_storage().nbytes()
            elif i not in entry.buffers:
                entry.static_args[i] = args[i]
                entry.addresses[i] = args[i].data_ptr()
        copied = [(i, self.made_by_splitting_op[i]) for i in entry.buffers if i in self.made_by_splitting_op]
        if copied:
            self.manager.note_once(
                ("copied", self.name), "torch_ext: %s copies %s into static buffers on every replay (%d bytes at "
                "batch size %s): the splitting op allocates its result. A splitting op that writes into a buffer "
                "the model allocates before the call (torch.empty_like, listed in mutates_args) leaves it in the "
                "graph before, where the graph after reads it without a copy (docs/guide/cuda-graphs.md).", self.name,
                ", ".join(f"input {i} '{self.inputs[i].name}' (from {op})" for i, op in copied),
                sum(entry.buffers[i].untyped_storage().nbytes() for i, _ in copied), entry.size)
        back = self._fill(entry, n, args)
        try:
            graph, out = self.manager.capture(self.runnable, entry.static_args, self._device, self.name, entry.size)
        except Exception as e:  # its static inputs are half set up: never capture this region again
            self.capturable, self.reason = False, f"capture failed ({type(e).__name__})"
            if self.fallback is None or not isinstance(e, CudaGraphCaptureError):
                raise
            # Capture only records kernels: nothing of this call ran on the device, so it runs again.
            self.manager.warn_once(("capture", self.name), f"torch_ext: {e}\nThe piecewise CUDA graphs serve every "
                                   "call from now on (cudagraph_mode='full_and_piecewise').")
            return self.fallback(*args)
        outs = self._outputs(out)
        entry.graph, entry.captured_at = graph, n
        self._retired = []  # the new graph holds the pool now
        for i in self._weight_positions:
            # The graph reads them by address; a weakly held weight set can go with its layer (a
            # tensor later at the same address has the same layout: Dynamo guards the graph's inputs).
            entry.static_args[i] = None
        self.manager.note_outputs(outs, entry.key)
        entry.outputs = [o if k in self.keep or not isinstance(o, torch.Tensor) else non_owning(o)
                         for k, o in enumerate(outs)]
        graph.replay()  # capture records without running: this call's results come from a replay
        for i, view in back:
            args[i].copy_(view)
        self._forget_plans(entry)
        self.group.captured(entry.key)
        # Owned outputs for this call: the memory stays taken until the forward is done with it.
        return self._result(outs, n)

    def _moved(self, entry: Entry, i: int, ptr: int, args):
        """A tensor the graph reads in place is at another address than at capture (generate makes a
        new cache per call; `load_state_dict(assign=True)` new parameters). Where the leader's
        parameters moved, the call names another weight set (RunnerGroup.choose_weights), served by
        its own graphs. Otherwise every graph of the group at this key is captured again there, after
        a warm-up, as CUDA graph trees re-record: the group's graphs of one key are captured in one
        forward call, so they are dropped and captured together."""
        if self.is_leader and self._weight_positions:  # whichever input moved first: weights decide
            self.group.choose_weights([args[j] for j in self._weight_positions])
        if self.group.weights != entry.key.weights:  # another layer's weights: their own graphs
            return self._slow(args, self._follow_weights(args))
        self.manager.note_once(("recapture", self.name), "torch_ext: %s: input %d '%s', read in place, moved "
                               "since the capture (a new cache or new weights?): the graphs of its forward are captured "
                               "again for the new address (a warm-up call, then a capture, at each move)", self.name, i,
                               self.inputs[i].name)
        for runner in self.group.runners:
            runner._retire(entry.key)
        self.group.restart(entry.key)
        cudagraph_stats.recaptures += 1
        return self._slow(args, None)

    def _retire(self, key) -> None:
        """Drop the graph of `key`; kept until its replacement is captured: the last graph of a private
        pool keeps the pool alive (capturing into a pool whose graphs are all gone fails an allocator assert)."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        if entry.graph is not None:
            self._retired.append(entry)
        self._forget_plans(entry)

    def _forget_plans(self, entry: Entry) -> None:
        plans = self._plans_by_weights.get(entry.key.weights, {})
        for n in [n for n, p in plans.items() if p.entry is entry]:
            del plans[n]

    # -- errors -----------------------------------------------------------------------------------

    def _moved_error(self, entry: Entry, i: int, arg: torch.Tensor, ptr: int) -> CudaGraphAddressError:
        spec = self.inputs[i]
        why = "a parameter or buffer (or a tensor marked with torch._dynamo.mark_static_address)"
        return CudaGraphAddressError(
            f"torch_ext CUDA graph of {self.name} (capture size {entry.size}, captured at batch size "
            f"{entry.captured_at}): input {i} '{spec.name}' was at 0x{ptr:x} when the graph was captured and is "
            f"now at 0x{arg.data_ptr():x}. It is {why}, so the graph reads it in place, from the address it "
            "had at capture. Keep such tensors where they are between calls: update them in place (copy_, "
            "index_copy_) instead of assigning new tensors, or run with cudagraph_mode='none'.")

    def _check(self, plan: Plan, args) -> None:
        for i, expected in plan.checked:
            spec = self.inputs[i]
            if spec.kind == CONST:
                if args[i] != expected:
                    raise CudaGraphAddressError(
                        f"torch_ext CUDA graph of {self.name}: argument {i} '{spec.name}' was {expected!r} at "
                        f"capture and is {args[i]!r} now; the graph holds the captured value, so "
                        "this call cannot replay it.")
            elif args[i].data_ptr() != expected:
                raise self._moved_error(plan.entry, i, args[i], expected)


def _replayer(graph) -> Callable:
    """graph.replay, bound to the C++ method when graph is a CUDAGraph (its Python override only
    calls super())."""
    base = getattr(torch._C, "_CUDAGraph", None)
    if base is not None and isinstance(graph, base):
        return base.replay.__get__(graph)
    return graph.replay
