"""Test helpers: compare compiled with eager (outputs and gradients), capture graphs, pin them.

    check_matches_eager(fn, *inputs)             outputs and gradients of eager/aot_eager/inductor == eager's
    capture_graphs(fn, *args, piecewise=True)    Dynamo's graphs (and the torch_ext backend's split graph
                                                 and pieces), from one compiled run
    assert_graph_snapshot("my_model.block", gm)  gm's code vs expected/my_model.block.txt beside the calling
                                                 test file; EXPECTTEST_ACCEPT=1 writes it
    normalized_graph(gm)                         gm's code as text stable across machines and torch versions,
                                                 for expecttest's assertExpectedInline(normalized_graph(gm), '''...''')
    activation_bytes(lambda: model(x))           (out, bytes the forward keeps for backward): compare
                                                 checkpointing under two compilers (torch_ext/memory.py)

Where snapshot files live (TORCH_EXT_SNAPSHOT_DIR, the `torch_ext_snapshot_dir` ini option of
torch_ext.pytest_plugin, `directory=`), and which torch version writes the shared `<name>.txt` and
which its own `<name>.torch<major>.<minor>.txt`: see torch_ext/snapshots.py.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch._dynamo
import torch.utils._pytree as pytree
from torch._dynamo.testing import CompileCounterWithBackend

from torch_ext.memory import activation_bytes
from torch_ext.snapshots import assert_graph_snapshot, graph_text, normalized_graph

__all__ = [
    "CapturedGraphs",
    "activation_bytes",
    "Compiled",
    "assert_graph_snapshot",
    "capture_graphs",
    "check_matches_eager",
    "graph_text",
    "normalized_graph",
]


@dataclasses.dataclass
class Compiled:
    """What one compiled run produced."""

    backend: str
    outputs: Any
    graphs: list[torch.fx.GraphModule]
    frame_count: int


def _clone_inputs(inputs: Sequence[Any]) -> list[Any]:
    def clone(t):
        if isinstance(t, torch.Tensor):
            c = t.detach().clone()
            c.requires_grad_(t.requires_grad)
            return c
        return t

    return [clone(t) for t in inputs]


def _grads(outputs: Any, inputs: Sequence[Any]) -> list[torch.Tensor | None]:
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    outs = [o for o in pytree.tree_leaves(outputs) if isinstance(o, torch.Tensor) and o.requires_grad]
    if not leaves or not outs:
        return []
    # A fixed random cotangent per output, so every output's gradient path is exercised.
    gen = torch.Generator().manual_seed(0)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in outs)
    return list(torch.autograd.grad(loss, leaves, allow_unused=True))


def check_matches_eager(
    fn: Callable,
    *inputs: Any,
    backends: Sequence[str] = ("eager", "aot_eager", "inductor"),
    dynamic: bool | None = False,
    fullgraph: bool = True,
    check_grads: bool = True,
    atol: float = 1e-5,
    rtol: float = 1e-5,
) -> dict[str, Compiled]:
    """Compile `fn` once per backend (fresh Dynamo state each time) and assert its outputs, and the
    gradients of its inputs that require grad, equal eager's. Returns what each backend captured."""
    eager_inputs = _clone_inputs(inputs)
    expected = fn(*eager_inputs)
    expected_grads = _grads(expected, eager_inputs) if check_grads else []
    results = {}
    for backend in backends:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)
        compiled_inputs = _clone_inputs(inputs)
        actual = torch.compile(fn, backend=counter, fullgraph=fullgraph, dynamic=dynamic)(*compiled_inputs)
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"[{backend}] outputs: {m}")
        if check_grads:
            actual_grads = _grads(actual, compiled_inputs)
            torch.testing.assert_close(actual_grads, expected_grads, atol=atol, rtol=rtol,
                                       msg=lambda m: f"[{backend}] gradients: {m}")
        results[backend] = Compiled(backend, actual, list(counter.graphs), counter.frame_count)
    return results


@dataclasses.dataclass
class CapturedGraphs:
    """What capture_graphs saw: Dynamo's graphs in the order captured and, with the torch_ext backend,
    per graph its split graph and the split graph's pieces (name -> fx graph, in call order). A graph
    compiled while autograd records is differentiated once: its split forward graph, in ATen ops."""

    outputs: Any
    graphs: list[torch.fx.GraphModule]
    split_graphs: list[torch.fx.GraphModule] = dataclasses.field(default_factory=list)
    pieces: list[dict[str, torch.fx.GraphModule]] = dataclasses.field(default_factory=list)


def _pieces(split_gm: torch.fx.GraphModule) -> dict[str, torch.fx.GraphModule]:
    """The split graph's pieces. A piece compiled by the backend is a runner object in the split graph's
    __dict__ keeping the piece's graph as `.graph_module` (pieces sharing one runner show the first one's)."""
    pieces = {}
    for node in split_gm.graph.nodes:
        if node.op == "call_module" and node.target not in pieces:
            piece = split_gm.__dict__.get(node.target)
            if piece is None:  # not compiled (a splitting op, or plain Python): still the submodule
                piece = getattr(split_gm, node.target)
            pieces[node.target] = getattr(piece, "graph_module", piece)
    return pieces


def capture_graphs(fn: Callable, *args: Any, backend_config: Any = None, piecewise: bool = False,
                   compile_options: dict | None = None, **kwargs: Any) -> CapturedGraphs:
    """Compile `fn` (a function or module) with a recording backend, call it once with `args` and
    `kwargs`, and return the graphs Dynamo captured. With `backend_config` (a torch_ext CompileConfig,
    cudagraph_mode="none") or `piecewise=True` (the default CompileConfig), the graphs are compiled by
    the torch_ext backend and its split graphs and pieces are returned too. `compile_options` go to
    torch.compile (e.g. {"dynamic": True}). Dynamo is reset before and after; torch_ext is left installed
    or not, as it was."""
    import torch_ext

    backend = None
    use_backend = backend_config is not None or piecewise
    if use_backend:
        from torch_ext.backend import CompileConfig, make_backend

        config = backend_config if backend_config is not None else CompileConfig()
        if config.cudagraph_mode != "none":
            raise ValueError("capture_graphs needs cudagraph_mode='none' (the split graph is the same): "
                             "pass dataclasses.replace(config, cudagraph_mode='none')")
    captured = CapturedGraphs(outputs=None, graphs=[])

    def record(gm, example_inputs):
        if backend is None:
            captured.graphs.append(gm)
            return gm.forward
        compiled = backend(gm, example_inputs)  # may make Dynamo trace again: record what it keeps
        # A training graph differentiated once (backend/joint.py): its split forward graph, in ATen ops.
        splits = getattr(compiled, "splits", None)
        split_gm = compiled if splits is None else splits.get("forward", splits.get("inference"))
        captured.graphs.append(gm)
        captured.split_graphs.append(split_gm)
        # A training graph with nothing to split at is one piece: the graph itself.
        captured.pieces.append(_pieces(split_gm) or {"graph": split_gm})
        return compiled

    was_installed = torch_ext.is_installed()
    torch._dynamo.reset()  # compile afresh, even if `fn` was compiled before
    try:
        if use_backend:
            backend = make_backend(config)  # installs torch_ext
        captured.outputs = torch.compile(fn, backend=record, **(compile_options or {}))(*args, **kwargs)
    finally:
        torch._dynamo.reset()  # drop the recording backend's code from fn's cache
        if not was_installed and torch_ext.is_installed():
            torch_ext.uninstall()
    return captured
