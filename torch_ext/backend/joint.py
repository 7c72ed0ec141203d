"""Training graphs, differentiated once: AOTAutograd over the whole Dynamo graph, then its forward
and backward graphs split at the splitting ops and run as straight-line code.

The split-per-piece path (backend.py with runtime/piecewise.py) differentiates each piece on its
own: every piece call goes through AOTAutograd's runtime wrappers and an autograd.Function, and a
checkpoint region holding a splitting op runs under torch.utils.checkpoint's hooks. That cost
Python at every step (HF Llama with gradient checkpointing, 4 layers on a CPU thread: 2.3x
Inductor's step). Here, as in plain Inductor, AOTAutograd traces the graph once with the
splitting ops as the opaque ops they are (custom ops; SDPA as the ATen attention op it becomes:
matcher.ATEN_FORMS), Inductor's min-cut partitioner honours checkpoint tags (memory as Inductor's,
selective policies included), and each graph it makes is split (split/splitter.py), its distinct
pieces compiled by Inductor once (compile/aten_pieces.py) and called from generated code
(runtime/straight_line.py): one autograd.Function per graph, not per piece. Where the partitioner
treated a layer apart at the model's ends (a value of the whole model recomputed in one layer's piece,
another tensor saved for the first layer), its piece still shares its siblings' compile
(split/hoist.py, compile/siblings.py): a 32-layer Llama compiles 6 distinct pieces.

Used for graphs compiled while autograd records, unless a splitting op would not survive
AOTAutograd as one call (a Python function Dynamo kept whole, a composite custom op) or
CompileConfig.differentiate_once is off: those keep the split-per-piece path, said once.
"""
from __future__ import annotations

import logging
import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from torch_ext import compat
from torch_ext.backend import dump
from torch_ext.backend.compile.aten_pieces import AtenPieceCompiler, value_strides
from torch_ext.backend.compile.compiler import say_fallback_once
from torch_ext.backend.compile.siblings import PeeledPiece, peel_prologues, share_outputs
from torch_ext.backend.compile.stack_room import with_stack_room
from torch_ext.backend.config import CompileConfig, resolve_op
from torch_ext.backend.counters import counters
from torch_ext.backend.runtime import layout
from torch_ext.backend.runtime.graphed_whole import mutated_inputs, whole_capture_refusal
from torch_ext.backend.runtime.pool_gradients import POOL_GRADIENTS, GraphedBackward, LeafScan
from torch_ext.backend.runtime.straight_line import straight_line
from torch_ext.backend.split.hoist import hoist_shared_values
from torch_ext.backend.split.matcher import ATEN_FORMS, SplittingOpMatcher
from torch_ext.backend.split.splitter import all_calls, is_trivial, split_graph
from torch_ext.backend.split.values import fill_missing_values

log = logging.getLogger("torch_ext.backend")


def _decomposes(op: Any) -> bool:
    """Whether AOTAutograd traces through `op` (a CompositeImplicitAutograd kernel) instead of keeping it."""
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(o.name(), "CompositeImplicitAutograd")
               for o in compat.op_overloads(op))


def why_not_joint(gm: fx.GraphModule, matcher: SplittingOpMatcher, config: CompileConfig) -> str | None:
    """Why a training graph keeps the split-per-piece path, or None where it is differentiated once."""
    if not config.differentiate_once:
        return "CompileConfig.differentiate_once is False"
    names = {matcher.match(node) for node in all_calls(gm)} - {None}
    for name in sorted(names):  # each op resolved once, not per call
        op = resolve_op(name)
        packet = op.overloadpacket if isinstance(op, torch._ops.OpOverload) else op
        if getattr(packet, "_qualified_op_name", None) in ATEN_FORMS:
            continue
        if not isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return f"splitting op {name} is a Python function, which AOTAutograd would trace through"
        if _decomposes(op):
            return f"splitting op {name} has a CompositeImplicitAutograd kernel, which AOTAutograd would trace through"
        if not compat.has_autograd_formula(op):
            return f"splitting op {name} has no autograd formula (register_autograd), which AOTAutograd needs"
    return None


class JointCompiler:
    """One per backend: compiles training graphs through AOTAutograd once, in pieces."""

    def __init__(self, config: CompileConfig, matcher: SplittingOpMatcher, patches: Callable[[fx.GraphModule], dict]):
        self.config = config
        self.matcher = matcher
        self.patches = patches  # the Inductor options a graph compiles with (compiler.InductorCompiler)
        self.pieces = AtenPieceCompiler(dedup=config.dedup)
        self._said: set[str] = set()

    def compile(self, gm: fx.GraphModule, example_inputs, label: str, dumper=None) -> "JointGraph":
        wanted = sum(1 for node in all_calls(gm) if self.matcher.match(node))
        splits: dict[str, fx.GraphModule] = {}
        static_names: set[str] = set()  # the forward's parameters and buffers, by name (_static_names)
        patches = self.patches(gm)
        if self.config.training_cudagraphs:
            # AOTAutograd then hands inner_compile Inductor's CUDA-graph arguments, as for mode="reduce-overhead".
            patches = {**patches, "triton.cudagraphs": True}
            devices = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
            if devices != {"cuda"}:
                self._say_once(f"training_cudagraphs: {label} has inputs on {sorted(devices)}, not only CUDA: "
                               "Inductor captures no CUDA graph for it")

        def inner_compile(graph: fx.GraphModule, inputs, **kwargs):
            is_backward = bool(kwargs.get("is_backward", False))
            kind = "backward" if is_backward else "inference" if kwargs.get("is_inference") else "forward"
            # The backward graph compiles at the first backward, outside the backend's call (with_stack_room).
            compiled = with_stack_room(self._compile_graph, graph, inputs, kwargs, kind, f"{label} {kind}", wanted,
                                       dumper, splits, static_names)
            if is_backward and kwargs.get("cudagraphs"):  # still on once the pieces compiled: graphs replay
                return GraphedBackward(compiled, kwargs["cudagraphs"])
            return compiled

        for node in gm.graph.find_nodes(op="placeholder"):
            if not hasattr(node, "_dynamo_source"):  # a graph a warm start loaded: GraphPickler keeps meta only
                node._dynamo_source = None  # AOTAutograd dedups inputs by source; None is "unknown"
        try:
            compiled = compat.compile_joint(gm, example_inputs, inner_compile, patches, self.matcher.overloads())
        except compat.backend_fallback_exceptions() as e:  # Dynamo runs the frame eagerly, as under Inductor
            say_fallback_once(label, e)
            raise
        counters.joint_graphs += 1
        return JointGraph(compiled, splits, graphed=self.config.training_cudagraphs)

    def is_splitting(self, node: fx.Node) -> bool:
        """A splitting op in an ATen graph: called directly, or by the HOP that runs an op with the RNG
        state saved (forward) or restored (backward's recompute) in a checkpoint region on some torch."""
        if self.matcher.match(node) is not None:
            return True
        return compat.is_rng_state_hop(node) and \
            any(self.matcher.match_target(a) for a in node.args if isinstance(a, torch._ops.OpOverload))

    def _compile_graph(self, graph: fx.GraphModule, inputs, kwargs: dict, kind: str, label: str, wanted: int,
                       dumper, splits: dict, forward_static: set[str]) -> Callable:
        if not any(self.is_splitting(node) for node in all_calls(graph)):
            if wanted and kind != "backward":
                self._say_once(f"AOTAutograd turned the splitting ops of {label} into ops torch_ext cannot "
                               f"match ({', '.join(self.matcher.names)}); it runs unsplit")
            # Nothing to split at: Inductor's own compile of the graph, exactly as plain Inductor's.
            splits[kind] = graph
            return self.pieces.compile_whole(graph, inputs, kwargs, label)
        whole = self._replayed_whole(graph, kwargs, label)
        fill_missing_values(graph.graph)  # a value crossing pieces is a piece's example input
        hoist_shared_values(graph, self.is_splitting)  # so that no layer's piece computes them for the rest
        split = split_graph(graph, self.is_splitting, "inline")
        splitting = [p for p in split.pieces if p.kind == "splitting"]
        is_backward, is_inference = kind == "backward", kind == "inference"
        static_names = self._static_names(graph, kwargs, kind, forward_static)
        callables: dict[str, Callable] = {}
        compiled = {}
        compute = {p.name: p.graph_module for p in split.pieces
                   if p.kind == "compute" and not is_trivial(p.graph_module)}
        peels = {}
        if self.pieces.dedup:  # a layer the partitioner treated apart at its ends still shares its siblings' compile
            share_outputs(split.split_gm, compute)
            peels = peel_prologues(compute, lambda g, name: straight_line(g, {}, f"{label} {name}", boxed=False))
        for piece in split.pieces:
            gm = piece.graph_module
            if piece.name in compute:
                peeled = peels.get(piece.name)
                target = peeled.remainder if peeled else gm
                compiled[piece.name] = callables[piece.name] = self.pieces.compile(
                    target, is_backward=is_backward, is_inference=is_inference, label=f"{label} {piece.name}",
                    cudagraphs={"cudagraphs": compat.no_cudagraphs()} if whole else
                    _cudagraph_arguments(target, kwargs, static_names))
                if peeled:
                    compiled[piece.name] = callables[piece.name] = PeeledPiece(peeled, compiled[piece.name])
                checks, sources = _inputs_laid_out_otherwise(split.split_gm, piece.name, gm, compiled)
                if checks:
                    counters.relaid_inputs += len(checks)
                    compiled[piece.name] = callables[piece.name] = layout.LaidOutPiece(
                        compiled[piece.name], checks, f"{label} {piece.name}", sources)
                counters.pieces += 1
            else:  # a splitting op, or sizes and tuple unpacking: plain Python, inlined
                callables[piece.name] = straight_line(gm.graph, {}, f"{label} {piece.name}", boxed=False)
        counters.splitting_op_calls += len(splitting)
        self._report_output_strides(split.split_gm, compiled)
        splits[kind] = split.split_gm
        if dumper:
            dumper.graph(f"{kind}_split_graph.py", split.split_gm, f"the {kind} graph AOTAutograd made, split")
        run = straight_line(split.split_gm.graph, callables, label)
        dump.trace_artifact(f"torch_ext_{kind}_runner", lambda: run.source)
        if whole:
            return self._whole_graph(run, graph, kwargs, kind)
        return run

    def _replayed_whole(self, graph: fx.GraphModule, kwargs: dict, label: str) -> bool:
        """Whether the split graph is replayed as one CUDA graph (training_cudagraphs="whole", where
        AOTAutograd asked for graphs and the graph can be one); where it cannot, its pieces are, said once."""
        if self.config.training_cudagraphs != "whole" or not kwargs.get("cudagraphs"):
            return False
        if any(device.type != "cuda" for device in _input_devices(graph)):
            return False  # no CUDA graph at all: compile() said so
        reason = whole_capture_refusal(graph, kwargs.get("static_input_idxs"))
        if reason:
            self._say_once(f"training_cudagraphs='whole': {label} replays its pieces as CUDA graphs of their own, "
                           f"the splitting ops eagerly between them: {reason}")
            return False
        return True

    @staticmethod
    def _whole_graph(run: Callable, graph: fx.GraphModule, kwargs: dict, kind: str) -> Callable:
        """`run` under the CUDA-graph trees as one graph; the forward tells AOTAutograd its device, as
        Inductor's post-compile does (the backward's trees run under the forward's manager)."""
        boxed_device = kwargs.get("boxed_forward_device_index")
        device = next((d.index for d in _input_devices(graph) if d.index is not None), None)
        if device is None:  # no tensor input with an index: the forward's, else the current one
            device = boxed_device.value if boxed_device is not None and boxed_device.value is not None \
                else torch.cuda.current_device()
        if kind == "forward" and boxed_device is not None:
            boxed_device.set(device)
        counters.graphed_whole += 1
        return compat.cudagraph_trees_whole(run, graph, static_input_idxs=kwargs.get("static_input_idxs") or (),
                                            mutated_input_idxs=mutated_inputs(graph.graph), device_index=device,
                                            is_backward=kind == "backward", is_inference=kind == "inference")

    @staticmethod
    def _static_names(graph: fx.GraphModule, kwargs: dict, kind: str, forward_static: set[str]) -> set[str]:
        """Names of the graph's inputs that keep their memory from call to call (parameters, buffers):
        the forward's static inputs as AOTAutograd names them; the backward reads the same tensors
        under the same names (AOTAutograd names a saved input after its forward placeholder)."""
        if kind != "backward":
            placeholders = list(graph.graph.find_nodes(op="placeholder"))
            names = {placeholders[i].name for i in kwargs.get("static_input_idxs", ()) if i < len(placeholders)}
            forward_static.update(names)
            return names
        return forward_static

    @staticmethod
    def _report_output_strides(split_gm: fx.GraphModule, compiled: dict) -> None:
        """Tell AOTAutograd the strides of the forward graph's outputs (it restrides the saved
        activations the backward graph is traced with): Inductor's choice where a piece made the
        output, the traced strides where an eager op or an input did."""
        strides = compat.enclosing_output_strides()
        if strides is None:
            return
        for out in split_gm.graph.output_node().args[0]:
            source, index = out, 0
            if isinstance(out, fx.Node) and out.op == "call_function" and out.target is operator.getitem:
                source, index = out.args
            piece = compiled.get(source.target) if isinstance(source, fx.Node) and source.op == "call_module" else None
            if piece is not None and piece.output_strides is not None:
                strides.append(piece.output_strides[index])
            else:
                strides.append(value_strides(out.meta.get("val")) if isinstance(out, fx.Node) else None)

    def _say_once(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            log.warning("torch_ext: %s", message)


def _input_devices(graph: fx.GraphModule) -> list[torch.device]:
    """Devices of the graph's tensor inputs (from their fakes)."""
    return [value.device for value in (node.meta.get("val") for node in graph.graph.find_nodes(op="placeholder"))
            if isinstance(value, torch.Tensor)]


def _producer(value: Any) -> tuple[str, int] | None:
    """(piece, output index) of a split graph's value that a piece returned; None for anything else."""
    if not isinstance(value, fx.Node):
        return None
    if value.op == "call_module":
        return value.target, 0
    source = value.args[0] if value.op == "call_function" and value.target is operator.getitem else None
    if isinstance(source, fx.Node) and source.op == "call_module" and isinstance(value.args[1], int):
        return source.target, value.args[1]
    return None


def _inputs_laid_out_otherwise(split_gm: fx.GraphModule, name: str, piece: fx.GraphModule, compiled: dict):
    """Layout checks for the inputs of piece `name` that an earlier compiled piece returns with other
    strides than this piece's fakes (Inductor reports what its code returns: runtime/layout.py's
    LaidOutPiece says when that differs), and what makes each; none for a usual piece."""
    call = next(iter(split_gm.graph.find_nodes(op="call_module", target=name)))
    fakes = [node.meta.get("val") for node in piece.graph.find_nodes(op="placeholder")]
    sources: dict[int, str] = {}
    for index, (arg, fake) in enumerate(zip(call.args, fakes)):
        made_by = _producer(arg)
        producer = compiled.get(made_by[0]) if made_by else None
        strides = getattr(producer, "output_strides", None)
        if not isinstance(fake, torch.Tensor) or strides is None or made_by[1] >= len(strides):
            continue
        if not layout.strides_agree(fake, strides[made_by[1]]):
            sources[index] = f"output {made_by[1]} of {made_by[0]}"
    return layout.checks_for(fakes, sources), sources


def _cudagraph_arguments(piece: fx.GraphModule, kwargs: dict, static_names: set[str]) -> dict | None:
    """compile_fx_inner's CUDA-graph arguments for a piece, where AOTAutograd asked for CUDA graphs:
    its inputs that are the graph's static ones are static to Inductor's CUDA-graph trees (read in
    place); the rest are copied in, but for outputs of an earlier piece, which the trees know as theirs."""
    if not kwargs.get("cudagraphs"):
        return None
    placeholders = piece.graph.find_nodes(op="placeholder")
    return {"cudagraphs": kwargs["cudagraphs"], "graph_id": kwargs.get("graph_id"),
            "boxed_forward_device_index": kwargs.get("boxed_forward_device_index"),
            "static_input_idxs": [i for i, node in enumerate(placeholders) if node.name in static_names]}


class JointGraph(torch.nn.Module):
    """What Dynamo calls for a training graph differentiated once. `splits`: the split forward (or
    inference) and backward graphs by kind, whose pieces are plain submodules (for tests and dumps);
    an nn.Module, so the config reporter can hook its second call. `graphed`: its pieces may replay
    under CUDA-graph trees, so gradients a graphed backward left in their pool are moved out before
    the trees start a new generation (runtime/pool_gradients.py)."""

    def __init__(self, compiled: Callable, splits: dict[str, fx.GraphModule], graphed: bool = False):
        super().__init__()
        self.compiled = compiled
        self.splits = splits
        self.graphed = graphed
        self._leaf_scan = LeafScan()

    def forward(self, *args):
        if self.graphed:
            POOL_GRADIENTS.note_leaves(args, self._leaf_scan)
            POOL_GRADIENTS.before_forward()
        return self.compiled(*args)
