"""CUDA graphs for the torch_ext backend: capture per batch size, replay, pad up to capture sizes.

cudagraph_mode="piecewise": every compiled piece of the split graph is wrapped in a
`CudaGraphRunner`; splitting ops run eagerly between the replays, at the real batch size.
cudagraph_mode="full": the whole split graph, splitting ops included, is one runner; its
splitting ops must be capturable and, when a batch is padded, must leave the padding rows harmless.
cudagraph_mode="full_and_piecewise" (vLLM's FULL_AND_PIECEWISE): both; a call replays the full
graph where one serves it (capture sizes up to full_cudagraph_max_size, a capturable graph) and
falls back to the piecewise graphs otherwise: larger batches, a full graph whose shapes cannot
be padded, or one whose capture failed (a splitting op that syncs with the host: warned once).

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
baked into the graph and checked on every replay (new weights capture again; an error with
cudagraph_check_addresses). A user tensor
that the graph writes in place (a KV cache) is read in place too, and its address is verified on
every replay: a moved cache would otherwise be silently stale, so the graphs of that call's forward
are captured again for the new address. A cache with the batch dim (one per batch size, as
generate makes) is read in place by calls at exactly a capture size; a padded call (n rows, graph
of P) has graphs of its own that copy it in and out (RunnerGroup.key). Every other
tensor is copied into a static buffer, except when it already lives in the output of a graph
captured for the same size, static shapes included (the residual stream between pieces): then
the graph reads it there, its address checked on every replay.

Memory. One private pool per device, shared by every graph of the backend. All graphs of one
compiled graph capture a size during one forward call, in call order: an output that a later
piece reads is alive while the pieces in between are captured, so the allocator never gives its
memory to them. After capture, outputs are kept as non-owning tensors, so the graphs of other
sizes reuse that memory; outputs that leave the compiled graph stay owned, so a result survives
calls at other sizes (the next call at the same size overwrites it, as with reduce-overhead).

Padding assumes rows of the batch dim are computed independently (token-wise decoder compute). A
region that writes in place into a tensor without the batch dim (outside splitting ops) would
write padding rows into it, so such a region is only captured at exact capture sizes.

Files: this module is the manager (analysis of the Dynamo graph, wrapping); capture.py owns the
shared pool and captures; runner.py captures and replays one region (plan.py: what it holds per size), group.py times
the captures of one graph; padding.py holds the shapes as functions of the batch size;
split/graph_writes.py finds inputs written in place; errors.py and stats.py are imported by the dispatcher and by tests without the rest.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import operator
import re
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx

from torch_ext.backend.config import CompileConfig
from torch_ext.backend.runtime.cudagraph.errors import (CudaGraphAddressError, CudaGraphBufferMutationError,
                                                CudaGraphCaptureError, CudaGraphError, mutation_error)
from torch_ext.backend.runtime.cudagraph.capture import GraphCapture, capture_sizes
from torch_ext.backend.runtime.cudagraph.concurrency import CallOrder, SerializedGraph
from torch_ext.backend.runtime.cudagraph.group import RunnerGroup
from torch_ext.backend.runtime.cudagraph.runner import CudaGraphRunner
from torch_ext.backend.runtime.cudagraph.stats import CudaGraphStats, cudagraph_stats
from torch_ext.backend.runtime.direct_call import call_directly
from torch_ext.backend.split.graph_writes import fake_value, written_placeholders
from torch_ext.backend.runtime.cudagraph.padding import (COPIED, PINNED, STATIC, TENSOR, NotCapturable, OtherSymbols,
                                                        padded_size, spec_of)
from torch_ext.backend.runtime.piecewise import CompiledPiece, batch_symbol
from torch_ext.backend.split.splitter import SplitGraph

log = logging.getLogger("torch_ext.backend.cudagraph")  # the name docs/guide/troubleshooting.md documents

__all__ = [
    "CudaGraphAddressError",
    "CudaGraphBufferMutationError",
    "CudaGraphCaptureError",
    "CudaGraphError",
    "CudaGraphManager",
    "CudaGraphRunner",
    "CudaGraphStats",
    "capture_sizes",
    "cudagraph_stats",
    "padded_size",
    "written_placeholders",
]

_STATIC_NAME = re.compile(r"(^|_)(buffers|parameters)_")


@dataclasses.dataclass
class GraphInfo:
    """What `prepare` learnt from the Dynamo graph, for `wrap`."""

    name: str
    symbol: Any
    placeholders: dict[str, tuple[Any, bool, bool, bool]]  # name -> (value, static, written, written by non-splitting op)
    outputs: list[Any]



class CudaGraphManager(GraphCapture):
    """CUDA graphs for one backend (one CompileConfig): what is captured, the runners, warnings; the
    shared pool and the capture itself are GraphCapture's (capture.py)."""

    def __init__(self, config: CompileConfig):
        super().__init__()
        self.config = config
        self.mode = config.cudagraph_mode
        self.sizes = tuple(config.cudagraph_capture_sizes)
        self.num_warmup = max(1, config.cudagraph_num_warmup)
        self.check_addresses = config.cudagraph_check_addresses
        # The decode ops left to their default: a call run without a graph has them run their reference
        # (kernels/launch_policy.py: their kernels pay off only where a graph replays the launches).
        self.reference_ops = frozenset(op for op in ("decode_attention", "decode_linear") if getattr(config, op) is None)
        self.call_order = CallOrder()  # the graphs share one pool: one call at a time among them
        self.bar_disabled = {True: False, False: True, None: None}[config.progress_bar]
        self._noted: set = set()
        self.groups: list[RunnerGroup] = []  # one per compiled graph, for inspection
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

    def capture_size(self, n: int | None, max_size: int | None = None):
        """The capture size a call at batch n pads to (None: it runs without a graph)."""
        if n is None or n < 1:
            return None
        size = padded_size(n, self.sizes)
        return None if size is None or (max_size is not None and size > max_size) else size

    def warn_once(self, key, msg: str) -> None:
        if key not in self._noted:
            self._noted.add(key)
            warnings.warn(msg, stacklevel=3)

    def note_once(self, key, msg: str, *args) -> None:
        if key not in self._noted:
            self._noted.add(key)
            log.info(msg, *args)

    def warn_cpu_once(self) -> None:
        self.warn_once(("cpu",), f"torch_ext: cudagraph_mode={self.mode!r} but the inputs are not on a CUDA device "
                       "(or CUDA is unavailable): the compiled pieces run without CUDA graphs.")

    # -- analysis of the Dynamo graph ---------------------------------------------------------------

    def prepare(self, gm: fx.GraphModule, is_splitting: Callable[[fx.Node], bool], name: str) -> GraphInfo:
        """Read the Dynamo graph (after HOP inlining); refuse module state mutated outside splitting ops."""
        written = written_placeholders(gm)
        written_outside = written_placeholders(gm, skip=is_splitting)
        placeholders = {}
        for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
            static = "_dynamo_static_input_type" in node.meta.get("tensor_dict", {})
            placeholders[node.name] = (fake_value(node), static, i in written, i in written_outside)
            if static and i in written_outside and _STATIC_NAME.search(node.name.lower()):
                raise mutation_error(node, written_outside[i])
        output = gm.graph.output_node().args[0]
        outputs = [fake_value(o) if isinstance(o, fx.Node) else o
                   for o in (output if isinstance(output, (tuple, list)) else (output,))]
        return GraphInfo(name, batch_symbol(gm), placeholders, outputs)

    # -- wrapping -------------------------------------------------------------------------------

    def wrap(self, split: SplitGraph, info: GraphInfo) -> Callable:
        """Put runners in: around each top-level compiled piece ("piecewise"), around the whole split
        graph ("full"), or both ("full_and_piecewise": the full graph's runner falls back to the
        piecewise graphs). HOP bodies split in_body mode run without graphs. What is returned runs
        one call at a time (concurrency.SerializedGraph)."""
        if not self.graphs_available():
            self.warn_cpu_once()
        split_gm = split.split_gm
        if self.mode == "full":
            return SerializedGraph(self._full_runner(split_gm, info, None), info.name, self.call_order)
        # The full graph captures plain pieces: it gets its own module before runners go in.
        full_gm = copy.copy(split_gm) if self.mode == "full_and_piecewise" else None
        self._wrap_pieces(split, info)
        # Many threads or streams may call it: one call at a time over the static memory (concurrency.py).
        return SerializedGraph(split_gm if full_gm is None else self._full_runner(full_gm, info, split_gm), info.name,
                               self.call_order)

    def _full_runner(self, split_gm: fx.GraphModule, info: GraphInfo, fallback: Callable | None) -> CudaGraphRunner:
        group = RunnerGroup(self, f"{info.name} (full graph)")
        self.groups.append(group)
        nodes = [n for n in split_gm.graph.nodes if n.op == "placeholder"]
        inputs, reason = self._input_specs(nodes, [fake_value(n) for n in nodes], info, None)
        outputs, out_reason = self._output_specs(info.outputs, info)
        # Writes by splitting ops are theirs to make padding-safe (the full-mode contract).
        exact = any(info.placeholders.get(n.name, (None,) * 4)[3] and not spec.batch_dims
                    for n, spec in zip(nodes, inputs) if spec.kind == TENSOR)
        reason = reason or out_reason
        if reason is not None and fallback is not None:
            self.note_once(("full", info.name), "torch_ext: %s has no full CUDA graph (%s): its piecewise graphs "
                           "serve every call", info.name, reason)
        return CudaGraphRunner(group, split_gm, group.name, inputs, outputs, info.symbol, False,
                               set(range(len(outputs))), exact, reason, self.config.full_cudagraph_max_size, fallback)

    def _wrap_pieces(self, split: SplitGraph, info: GraphInfo) -> None:
        group = RunnerGroup(self, info.name)
        self.groups.append(group)
        split_gm = split.split_gm
        if any(p.kind == "hop" and p.checkpoint is None for p in split.pieces):  # (checkpoints: training only)
            self.note_once(("in_body",), "torch_ext: pieces inside HOP bodies split in_body run without CUDA "
                           "graphs (a body is shared by its call sites); hop_split='inline' captures them")
        for node in list(split_gm.graph.nodes):
            if node.op != "call_module":
                continue
            piece = split_gm.__dict__.get(node.target)
            if not isinstance(piece, CompiledPiece):
                sub = split_gm._modules.get(node.target)
                if isinstance(sub, fx.GraphModule):
                    for op in call_directly(sub):
                        self.note_once(("direct", op), "torch_ext: splitting op %s (torch.library.custom_op) is called "
                                       "without its Python dispatch layers between graph replays when no autograd, "
                                       "mode or autocast needs them (backend/runtime/direct_call.py)", op)
                    # A splitting op's partition runs eagerly between two replays, on the critical
                    # path: call its code without nn.Module.__call__ (no hooks on these partitions).
                    split_gm.__dict__[node.target] = sub.forward
                continue
            written = written_placeholders(piece.graph_module)
            inputs, reason = self._input_specs(list(node.args), piece.example_inputs, info, written)
            out_node = piece.graph_module.graph.output_node().args[0]
            outputs, out_reason = self._output_specs([fake_value(o) if isinstance(o, fx.Node) else o for o in out_node],
                                                     info)
            exact = any(i in written and not s.batch_dims for i, s in enumerate(inputs) if s.kind == TENSOR)
            runner = CudaGraphRunner(group, piece, f"{info.name}/{node.target}", inputs, outputs, info.symbol,
                                     piece.single_output, _escaping(split_gm, node), exact, reason or out_reason)
            runner.made_by_splitting_op = _made_by_splitting_op(split_gm, node)
            split_gm.__dict__[node.target] = runner

    def _input_specs(self, arg_nodes: list, values: list, info: GraphInfo, written: dict | None):
        """Specs of a region's inputs; `written` = inputs the region writes (None: the whole graph)."""
        specs = []
        try:
            for i, (node, value) in enumerate(zip(arg_nodes, values)):
                name = node.name if isinstance(node, fx.Node) else repr(node)
                spec = spec_of(value, info.symbol, name)
                top = info.placeholders.get(name) if isinstance(node, fx.Node) and node.op == "placeholder" else None
                spec.written = bool(top and top[2]) if written is None else i in written
                if spec.kind == TENSOR and top is not None:
                    if top[1] and not spec.batch_dims:
                        spec.role = STATIC
                    elif spec.written:
                        # Copying a KV cache in and out on every call would cost its size twice (and a
                        # static buffer of its size per capture size): read where it is. With the batch
                        # dim, only by calls at exactly a capture size (runner.py).
                        spec.role = PINNED
                spec.written = spec.written and spec.role == COPIED  # copied back after each run
                if spec.written and spec.expanded:
                    raise NotCapturable("it is an expanded tensor (stride 0) the region writes")
                specs.append(spec)
        except NotCapturable as e:
            return [], self._not_capturable(info.name, f"input {name!r}", e)
        return specs, None

    def _output_specs(self, values: list, info: GraphInfo):
        try:
            return [spec_of(v, info.symbol, f"output {k}", output=True) for k, v in enumerate(values)], None
        except NotCapturable as e:
            return [], self._not_capturable(info.name, "an output", e)

    def _not_capturable(self, graph: str, where: str, e: NotCapturable) -> str:
        """The reason a region is never captured. Sizes other than the batch size are said once per
        graph as a warning: the user asked for CUDA graphs, and the usual cause is theirs to change."""
        reason = f"{where}: {e}"
        if isinstance(e, OtherSymbols):
            self.warn_once(("symbols", graph), f"torch_ext: {graph} runs without CUDA graphs: {reason}. Graphs are "
                           "captured per batch size, the dynamic dim 0 of an input tensor; dynamic=True makes every "
                           "dim dynamic, and a Python int that changes between calls (a position) becomes a "
                           "dynamic size too. Mark only the batch dim dynamic (torch._dynamo.mark_dynamic(x, 0), "
                           "or dynamic=None) and pass changing ints as tensors.")
        return reason



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

