"""What one compiled graph is, as plain data: `GraphRecord.describe()`.

A warm start rebuilds the backend's result from a saved graph (warm_start/saved_graph.py) and loads
its pieces from the disk cache; nothing else checks that the program it loads is the one a cold
process compiled. The description holds what decides the code that runs: the pieces (fingerprint,
how often the graph calls each, torch_ext's ops in each graph, the Inductor options each compiles
with, the variants built so far), the merged projection groups, and the CUDA-graph plan (mode, capture
sizes, the decode ops that run their reference outside a graph, each runner's inputs and roles).
Two processes that run the same program describe it alike (tests/test_warm_start_fidelity.py);
`TorchExtBackend.describe()` lists the graphs of a backend, `torch_ext.backend.describe(compiled)`
those behind what torch_ext.compile returned.
"""
from __future__ import annotations

import collections
import hashlib
import json
from typing import Any

import torch

from torch_ext.backend.compile.compiler import GENERAL, InductorCompiler
from torch_ext.backend.rewrite.merge_projections import MergePlan


class GraphRecord:
    """What the backend made of one Dynamo graph (kept on the split graph: it lives as long as that)."""

    def __init__(self, kind: str, compiler: InductorCompiler, group=None, plan: MergePlan | None = None,
                 runner_groups: tuple = (), cudagraphs=None):
        self.kind = kind  # "inference" (pieces) or "training" (differentiated once: joint.py)
        self.compiler = compiler
        self.group = group  # runtime.piece_group.PieceGroup
        self.plan = plan
        self.runner_groups = runner_groups  # cudagraph.group.RunnerGroup of this graph
        self.cudagraphs = cudagraphs  # the backend's CudaGraphManager, or None

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.group is not None:
            out["pieces"] = [self._piece(p) for p in self.group.pieces.values()]
            out["splitting_ops"] = self.group.splitting_ops
        out["merged_projections"] = self.plan.describe() if self.plan is not None else None
        if self.cudagraphs is not None:
            out["cudagraphs"] = {
                "mode": self.cudagraphs.mode, "capture_sizes": list(self.cudagraphs.sizes),
                "reference_ops": sorted(self.cudagraphs.reference_ops),
                "runners": [_runner(r) for g in self.runner_groups for r in g.runners]}
        return out

    def _piece(self, piece) -> dict[str, Any]:
        gm = piece.graph_module
        ops = collections.Counter(_op_name(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return {
            "fingerprint": piece.fingerprint,
            "occurrences": piece.occurrences,
            "calls": sum(ops.values()),
            "torch_ext_ops": {k: v for k, v in sorted(ops.items()) if k.startswith("torch_ext::")},
            # What this process compiles the piece with (in the artifact's name: a loaded one was compiled so).
            "inductor_options": self.compiler.options_of(gm, GENERAL),
            "variants": sorted(v.label for v in piece.variants),
        }


def fingerprint(description: Any) -> str:
    """A short digest of a description (what a log line or a benchmark prints)."""
    return hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target.name()
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"hop::{target.__name__}"
    return getattr(target, "__name__", repr(target))


def _runner(runner) -> dict[str, Any]:
    return {
        "name": runner.name,
        "inputs": [f"{s.kind} {s.role} dims={list(s.batch_dims)} shape={[str(x) for x in s.shape]} {s.dtype}"
                   if s.kind == "tensor" else f"{s.kind} {s.expr if s.kind == 'scalar' else type(s.value).__name__}"
                   for s in runner.inputs],
        "outputs": len(runner.outputs),
        "exact_only": runner.exact_only,
        "captured": runner.reason is None,
        "reason": runner.reason,
    }
