"""Demo part `torch29`: on torch 2.9.1, a region returning a dataclass breaks the graph without
torch_ext and compiles as one graph with it (torch 2.10+ traces such outputs itself).

The probe runs in the interpreter of a sibling venv `.venv-torch2.9.1` (`make test-2.9.1` builds
it), as `python -m torch_ext.demo.torch29 --probe`, and prints its findings as JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from pathlib import Path

import torch

import torch_ext
from torch_ext.demo import show
from torch_ext.demo.beyond_torch import Program, compile_and_compare
from torch_ext.demo.worker import PACKAGE_PARENT, WorkerFailed, run_worker

VENV = ".venv-torch2.9.1"


@dataclasses.dataclass
class BlockOutput:
    hidden: torch.Tensor
    residual: torch.Tensor
    layer: int


@torch.compiler.nested_compile_region
def block(x):
    h = torch.relu(x)
    return BlockOutput(hidden=h, residual=x + h, layer=0)


def uses_block(x):
    out = block(x)
    return block(out.residual).residual * 2


PROGRAM = Program("a region returns a dataclass", "return BlockOutput(hidden=h, residual=x + h, layer=0)",
                  uses_block, (4,), False, lambda n: (torch.randn(n, 8, requires_grad=True),))


def probe() -> dict:
    """Run here, in the 2.9.1 interpreter: the program without and with torch_ext."""
    torch.manual_seed(0)
    findings = {"torch": torch.__version__}
    for label, context in (("vanilla", contextlib.nullcontext), ("torch_ext", torch_ext.installed)):
        with context():
            ok, result = show.attempt(lambda: compile_and_compare(PROGRAM))
        findings[label] = {"ok": ok, "reason": None if ok else result,
                           "graphs": result["graphs"] if ok else 0,
                           "equal_eager": ok and bool(result["equal_eager"])}
    return findings


def find_python() -> Path | None:
    """The sibling venv's interpreter, next to this checkout or in the current directory."""
    for root in (PACKAGE_PARENT, Path.cwd()):  # the checkout (where `make` builds venvs), or here
        python = root / VENV / "bin" / "python"
        if python.exists():
            return python
    return None


def run() -> dict:
    show.header("torch29", "torch 2.9.1 alone, then with torch_ext.install()")
    python = find_python()
    if python is None:
        print(f"  skipped: no {VENV} here; `make test-2.9.1` builds it, then run `make demo` again")
        return {"skipped": True}
    try:
        findings = run_worker(python, "torch_ext.demo.torch29", "--probe", timeout=300)
    except WorkerFailed as e:
        print(f"  {str(e)[:show.WIDTH - 2]}")
        return {"skipped": False, "failed": True}
    print(f"  in {VENV} (torch {findings['torch']}), {PROGRAM.title}:")
    print(f"     {PROGRAM.source}")
    show.table([(label, _outcome(findings[key])) for label, key in
                (("torch alone", "vanilla"), ("torch_ext.install()", "torch_ext"))], indent="     ")
    return {"skipped": False, "failed": False, **findings}


def _outcome(finding: dict) -> str:
    if not finding["ok"]:
        return f"refused: {show.shorten(finding['reason'], show.OUTCOME_WIDTH)}"
    graphs = f"{finding['graphs']} graph{'s' if finding['graphs'] != 1 else ''}"
    return f"compiled, {graphs}; outputs, grads equal eager: {finding['equal_eager']}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", action="store_true", help="print this interpreter's findings as JSON")
    if parser.parse_args().probe:
        print(json.dumps(probe()))
