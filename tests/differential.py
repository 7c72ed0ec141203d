"""Differential harness: each program of tests/hop_corpus.py compiled by vanilla torch and under
torch_ext.install(), in the running torch, on one backend; both compared with eager.

An outcome is "ok" (compiles fullgraph, outputs and input gradients equal eager's), "refused" (an
error while compiling) or "wrong" (compiles, differs from eager). The verdict per program:

    same    both ok with the same Dynamo graph (normalized), or both refused, or both wrong alike
    better  torch refuses (or is wrong), torch_ext is ok
    worse   anything else: torch compiles and torch_ext does not, or differently, or torch_ext is
            wrong where torch refuses

`python tests/differential.py [backend ...]` prints the counts per backend (docs/beyond_torch.md).
"""
from __future__ import annotations

import dataclasses
import sys

import torch
import torch._dynamo

import torch_ext
from torch_ext.testing import _grads, normalized_graph  # _grads: a fixed random cotangent per output, one definition

BACKENDS = ("eager", "aot_eager", "inductor")


@dataclasses.dataclass
class Outcome:
    status: str  # ok | refused | wrong
    detail: str = ""
    graphs: tuple[str, ...] = ()


def _clone(inputs):
    return [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
            for t in inputs]


def _differs(actual, expected) -> str:
    try:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    except AssertionError as e:
        return str(e).splitlines()[0]
    return ""


def run(program, backend: str) -> Outcome:
    """Compile and run `program` once on `backend` in Dynamo's current configuration (installed or not)."""
    inputs = program.make_inputs()
    torch.manual_seed(0)
    eager_inputs = _clone(inputs)
    expected = program.fn(*eager_inputs)
    expected_grads = _grads(expected, eager_inputs)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(normalized_graph(gm))
        if backend == "eager":
            return gm.forward
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    torch._dynamo.reset()
    compiled_inputs = _clone(inputs)
    torch.manual_seed(0)
    try:
        actual = torch.compile(program.fn, backend=record, fullgraph=True, dynamic=program.dynamic)(
            *compiled_inputs)
        actual_grads = _grads(actual, compiled_inputs)
    except Exception as e:  # any compile or run failure is a refusal of the program
        return Outcome("refused", f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
    finally:
        torch._dynamo.reset()
    why = _differs(actual, expected) or _differs(actual_grads, expected_grads)
    return Outcome("wrong" if why else "ok", why, tuple(graphs))


def compare(program, backend: str) -> tuple[str, Outcome, Outcome]:
    """(verdict, vanilla outcome, torch_ext outcome)."""
    was_installed = torch_ext.is_installed()
    torch_ext.uninstall()
    try:
        vanilla = run(program, backend)
        torch_ext.install()
        ours = run(program, backend)
    finally:
        if not was_installed:
            torch_ext.uninstall()
    if vanilla.status == ours.status == "ok":
        verdict = "same" if vanilla.graphs == ours.graphs else "worse"
    elif vanilla.status == ours.status:
        verdict = "same"
    elif ours.status == "ok":
        verdict = "better"
    else:
        verdict = "worse"
    return verdict, vanilla, ours


def table(backends=BACKENDS) -> dict[str, dict[str, int]]:
    from hop_corpus import PROGRAMS

    counts = {}
    for backend in backends:
        counts[backend] = {"same": 0, "better": 0, "worse": 0}
        for name, program in PROGRAMS.items():
            verdict, vanilla, ours = compare(program, backend)
            counts[backend][verdict] += 1
            print(f"{backend:9} {name:34} {verdict:6} vanilla={vanilla.status} torch_ext={ours.status}"
                  f" {ours.detail if verdict == 'worse' else ''}", file=sys.stderr)
    return counts


if __name__ == "__main__":
    import os

    sys.path.insert(0, os.path.dirname(__file__))
    result = table(tuple(sys.argv[1:]) or BACKENDS)
    print(f"torch {torch.__version__}: " + "; ".join(
        f"{b}: {c['same']} same, {c['better']} better, {c['worse']} worse" for b, c in result.items()))
