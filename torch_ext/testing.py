"""Test helpers: compare compiled with eager (outputs and gradients), and pin captured graphs.

Graph snapshots live in `expected/<name>.txt`. Where one torch version prints a graph differently,
its own file `expected/<name>.torch<major>.<minor>.txt` takes precedence for that version.
`EXPECTTEST_ACCEPT=1` (expecttest's switch) rewrites the snapshots from the current run.
"""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Callable, Sequence

import expecttest
import torch
import torch._dynamo
import torch.utils._pytree as pytree
from torch._dynamo.testing import CompileCounterWithBackend

from torch_ext import compat

EXPECTED_DIR = Path(os.environ.get("TORCH_EXT_EXPECTED_DIR", Path(__file__).resolve().parent.parent / "expected"))


SNAPSHOT_PRIMARY_VERSION = (2, 14)  # it and newer ones (2.15 prints the same) write the shared files


def _version_tag() -> str:
    return "torch{}.{}".format(*compat.TORCH_VERSION)


def graph_text(gm: torch.fx.GraphModule) -> str:
    """The readable code of a graph (and its subgraphs) without source-location comments, so a
    snapshot does not depend on file paths or line numbers."""
    text = gm.print_readable(print_output=False)
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# File:") or stripped.startswith("# No stacktrace"):
            continue
        if stripped.startswith("#") and " File: " in stripped:  # 2.11: "# ac_graph_id: <n> - ... File: ..."
            continue
        if not stripped:
            continue
        lines.append(line.rstrip())
    return "\n".join(lines) + "\n"


def assert_graph_snapshot(name: str, gm: torch.fx.GraphModule) -> None:
    """Compare `gm`'s code with the pinned snapshot `name` (see the module docstring)."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"snapshot name {name!r} must be letters, digits, '_', '.' or '-'")
    actual = graph_text(gm)
    shared = EXPECTED_DIR / f"{name}.txt"
    own = EXPECTED_DIR / f"{name}.{_version_tag()}.txt"
    expected_file = own if own.exists() else shared
    if expecttest.ACCEPT:
        # The newest supported torch owns the shared file; an older one that prints the same graph
        # needs no file of its own.
        if compat.TORCH_VERSION >= SNAPSHOT_PRIMARY_VERSION or not shared.exists():
            target = shared
        elif shared.read_text() == actual:
            own.unlink(missing_ok=True)
            return
        else:
            target = own
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(actual)
        return
    if not expected_file.exists():
        raise AssertionError(
            f"no snapshot {shared}; run with EXPECTTEST_ACCEPT=1 to record it. Captured graph:\n{actual}"
        )
    expected = expected_file.read_text()
    if expected != actual:
        import difflib

        diff = "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True),
                                            str(expected_file), "captured"))
        raise AssertionError(f"graph differs from snapshot (EXPECTTEST_ACCEPT=1 to update):\n{diff}")


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
