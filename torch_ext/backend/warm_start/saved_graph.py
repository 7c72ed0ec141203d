"""The torch_ext backend's compiled program as torch's AOT compile saves it (warm_start/program.py).

`SavedGraph` is what the backend hands Dynamo under warm start: the compiled split graph, plus what
rebuilds it in another process without tracing: the Dynamo graph as the backend's rewrite left it
(merged projections, with the plan of the buffers it takes; pickled by torch's GraphPickler with the
fake example values the backend reads: inputs, and values used across pieces) and the directory key
of its pieces in the disk cache. Loading it
runs the backend again on that graph (split, dedup, runners, CUDA-graph plan: all cheap) and
loads every piece from the disk cache, as vLLM's backend does.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import pickle
from typing import Any, Callable

import torch
import torch.fx as fx

from torch_ext import compat
from torch_ext.backend.compile.first_use import load_libraries
from torch_ext.backend.split.graph_writes import written_args
from torch_ext.backend.compile.example_values import VALUE_DROPPED, placeholder_values

log = logging.getLogger(__name__)

# Metadata Dynamo leaves on nodes that the backend never reads and that do not pickle (GraphArg
# holds the real example tensor; module stacks hold classes of user modules).
_DROPPED_META = ("grapharg", "nn_module_stack", "source_fn_stack", "original_aten", "from_node")


# The backend that loads a SavedGraph in this thread (set by warm_start around torch's deserialize).
loading_backend: contextvars.ContextVar = contextvars.ContextVar("torch_ext_warm_backend", default=None)


class SavedGraphError(RuntimeError):
    pass


def _describe_without_modes(desc):
    """A MetaTensorDesc with no fake mode on it or on its view bases (GraphPickler drops the mode of
    the tensor itself but pickles the one of a view's base, which fails)."""
    if desc is None:
        return None
    return dataclasses.replace(desc, fake_mode=None, base=_describe_without_modes(desc.base))


def _graph_pickler():
    from torch._subclasses import FakeTensor
    from torch.fx import _graph_pickler as gp

    class Pickler(gp.GraphPickler):
        def reducer_override(self, obj):
            if isinstance(obj, FakeTensor):
                unpickle, (data, state) = gp._TensorPickleData.reduce_helper(self, obj)
                data.metadata = _describe_without_modes(data.metadata)
                return unpickle, (data, state)
            return super().reducer_override(obj)

    return Pickler, gp


def _values_to_drop(gm: fx.GraphModule, is_splitting: Callable[[fx.Node], bool]) -> set[fx.Node]:
    """Nodes of one graph whose example tensor the backend never reads: computed and used inside
    one piece. Kept: placeholders, anything not a tensor, tensors used across a splitting op or a
    HOP call (conservatively a boundary too), by the output or a HOP, and tensors written in place
    (graph_writes follows views by their storage). Unpickling a fake tensor costs about 0.4 ms:
    most of a 32-layer graph's values are dropped."""
    from torch._subclasses import FakeTensor

    segment: dict[fx.Node, int] = {}
    current = 0
    for node in gm.graph.nodes:
        if is_splitting(node) or isinstance(node.target, torch._ops.HigherOrderOperator):
            segment[node] = current = current + 1  # a segment of its own
            current += 1
        else:
            segment[node] = current
    written = {arg for node in gm.graph.nodes for arg in written_args(node)}
    drop = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or node in written or segment[node] % 2:
            continue
        if not isinstance(node.meta.get("example_value", node.meta.get("val")), FakeTensor):
            continue
        if all(u.op in ("call_function", "call_method") and segment[u] == segment[node] for u in node.users):
            drop.add(node)
    return drop


def dump_graph(gm: fx.GraphModule, is_splitting: Callable[[fx.Node], bool]) -> bytes:
    """The Dynamo graph (and HOP bodies) with the example values the backend reads, as bytes. The
    graph is left as it was (Dynamo still reads the dropped metadata after the backend returns)."""
    pickler, gp = _graph_pickler()
    kept: list[tuple[fx.Node, dict]] = []
    try:
        for module in gm.modules():
            if isinstance(module, fx.GraphModule):
                inside_pieces = _values_to_drop(module, is_splitting)
                for node in module.graph.nodes:
                    names = _DROPPED_META + (("example_value", "val") if node in inside_pieces else ())
                    dropped = {k: node.meta.pop(k) for k in names if k in node.meta}
                    kept.append((node, dropped))
                    if node in inside_pieces:
                        node.meta[VALUE_DROPPED] = True  # what restore_example_values restores (split keeps meta)
        with compat.graph_pickler_maps_slices():  # cache[: x.shape[0]] under dynamic shapes (2.11)
            return pickler.dumps(gm, gp.Options(ops_filter=None))
    finally:
        for node, dropped in kept:
            node.meta.pop(VALUE_DROPPED, None)
            node.meta.update(dropped)


def load_graph(data: bytes) -> fx.GraphModule:
    from torch._subclasses import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    _, gp = _graph_pickler()
    with compat.graph_pickler_maps_slices():
        gm = gp.GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
    if not isinstance(gm, fx.GraphModule):
        raise SavedGraphError(f"the saved graph is a {type(gm).__name__}, not a GraphModule")
    gm.recompile()
    return gm


def _fake_mode(values):
    from torch._guards import detect_fake_mode

    return detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])


class SavedGraph(compat.SerializableCallable):
    """The backend's compiled graph, serializable by torch's AOT compile."""

    def __init__(self, compiled, graph: bytes, store_key: str | None, sources: list[str | None],
                 gm: fx.GraphModule, plan=None, libraries: tuple[str, ...] = ()):
        self.compiled = compiled
        self.libraries = libraries  # first-use libraries its calls load (compile/first_use.py)
        self.graph = graph  # the graph as the backend's rewrite left it (merged projections)
        self.store_key = store_key
        self.plan = plan  # the rewrite's MergePlan (the buffers the graph takes), or None
        self.sources = sources  # Dynamo's source name of each placeholder ("L['x']"), for guard-free dispatch
        self.gm = gm  # the Dynamo graph (fake example values), for graph_inputs

    @property
    def graph_inputs(self) -> dict[str, Any]:
        """Placeholders' example values by source name (what signature.CallSignature reads)."""
        return {s: v for s, v in zip(self.sources, placeholder_values(self.gm)) if s is not None}

    def __call__(self, *args):
        return self.compiled(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn: "SavedGraph") -> bytes:
        return pickle.dumps({"graph": fn.graph, "store_key": fn.store_key, "sources": fn.sources,
                             "plan": fn.plan, "libraries": fn.libraries})

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> "SavedGraph":
        backend = loading_backend.get()
        if backend is None:
            raise SavedGraphError("a torch_ext warm-start program loads only through torch_ext.compile")
        state = pickle.loads(data)
        gm = load_graph(state["graph"])
        example_inputs = placeholder_values(gm)
        mode = _fake_mode(example_inputs)
        context = torch._guards.tracing(torch._guards.TracingContext(mode)) if mode else contextlib.nullcontext()
        with context, compat.lazy_graph_modules():
            compiled = backend(gm, example_inputs, store_key=state["store_key"], rewritten=True,
                               plan=state.get("plan"))
        libraries = tuple(state.get("libraries", ()))
        load_libraries(libraries)
        return cls(compiled, state["graph"], state["store_key"], state["sources"], gm, state.get("plan"), libraries)


def backend_for_save(backend):
    """A Dynamo backend for compat.aot_compile: the torch_ext backend, its result made serializable."""

    def compile_and_keep(gm: fx.GraphModule, example_inputs):
        sources = [compat.placeholder_source(node) for node in gm.graph.find_nodes(op="placeholder")]
        # Saved after the rewrite (its choices need example values the saved graph drops), before the split.
        rewritten, plan = backend.rewrite(gm)
        graph = dump_graph(rewritten, lambda node: backend.matcher.match(node) is not None)
        compiled = backend(rewritten, example_inputs, rewritten=True, plan=plan)
        return SavedGraph(compiled, graph, backend.last_store_key, sources, gm, plan, backend.last_libraries)

    return compile_and_keep


def tensor_marks(arguments: dict[str, Any]) -> dict[tuple, dict]:
    """Dim markings (mark_dynamic & co.) of the argument tensors (by parameter name), by path
    (("x",), ("caches", 0))."""
    out: dict[tuple, dict] = {}

    def walk(path, value):
        if isinstance(value, torch.Tensor):
            attrs = {a: getattr(value, a) for a in compat.DIM_MARKING_ATTRS if hasattr(value, a)}
            if attrs:
                out[path] = {a: (v.copy() if hasattr(v, "copy") else v) for a, v in attrs.items()}
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(path + (i,), item)
        elif isinstance(value, dict):
            for k, item in value.items():
                walk(path + (k,), item)

    for name, value in arguments.items():
        walk((name,), value)
    return out
