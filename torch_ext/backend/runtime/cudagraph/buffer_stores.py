"""Refuse forwards that assign module buffers or parameters while CUDA graphs are on.

A forward that assigns `self.buf = ...` makes Dynamo's transformed code store a new tensor into the
module after each call, while captured graphs keep reading the old one (silently stale results).
The backend calls `expect_transformed_code` while Dynamo compiles such a frame; a bytecode hook then
finds the store in that frame's transformed code and raises CudaGraphBufferMutationError showing
it. (In-place updates of module state are refused at graph level, see manager.CudaGraphManager.prepare.)
"""
from __future__ import annotations

import dis
import types
from typing import Any

import torch

from torch_ext.backend.dump import decompile
from torch_ext.backend.runtime.cudagraph.errors import CudaGraphBufferMutationError

_STATE_DICTS = ("_buffers", "_parameters")

# Both functions run while Dynamo compiles a frame, under its compile lock: no lock of our own.
_hook_handle = None
# (compile id, what) for frames in which a backend with CUDA graphs compiled a graph; the hook for
# the same compile checks the frame's code (entries of aborted compiles are dropped).
_pending_checks: list[tuple[Any, str]] = []


def expect_transformed_code(what: str) -> None:
    """Called by a backend with CUDA graphs while Dynamo compiles a frame: check that frame's code."""
    global _hook_handle
    _pending_checks.append((torch._guards.CompileContext.current_compile_id(), what))
    if _hook_handle is None:
        _hook_handle = torch._dynamo.convert_frame.register_bytecode_hook(_check_transformed_code)


def _check_transformed_code(code: types.CodeType, new_code: types.CodeType):
    if not _pending_checks:
        return None
    current = torch._guards.CompileContext.current_compile_id()
    mine = [what for compile_id, what in _pending_checks if compile_id == current]
    _pending_checks.clear()  # entries of aborted compiles go too
    found = buffer_assignments(new_code) if mine else []
    if found:
        raise _assignment_error(code, new_code, found, mine[-1])
    return None


def _code_objects(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def buffer_assignments(code: types.CodeType) -> list[str]:
    """Stores of module buffers/parameters in Dynamo's transformed code: it replays such an
    assignment as `<module>._buffers.update({...})` (or `_parameters`) after the graph ran."""
    found = []
    for c in _code_objects(code):
        recent: list[dis.Instruction] = []  # `m._buffers.update` or `m.__dict__['_buffers'].update`
        for ins in dis.get_instructions(c):
            if ins.argval == "update" and ins.opname in ("LOAD_ATTR", "LOAD_METHOD"):
                state = [r for r in recent if r.argval in _STATE_DICTS]
                if state:
                    found.append(f"{state[-1].argval}.update (in {c.co_name}, bytecode offset {ins.offset})")
            recent = (recent + [ins])[-3:]
    return found


def _assignment_error(code, new_code, found: list[str], what: str) -> CudaGraphBufferMutationError:
    lines = []
    for line in decompile(new_code).splitlines():
        marked = ".update(" in line and any(name in line for name in _STATE_DICTS)
        lines.append((">>> " if marked else "    ") + line)
    return CudaGraphBufferMutationError(
        f"torch_ext: with CUDA graphs on ({what}), {code.co_name}() at "
        f"{code.co_filename}:{code.co_firstlineno} assigns module buffers or parameters: "
        f"{'; '.join(found)}. Captured graphs read module state in place from the addresses it had at "
        "capture, so a newly assigned tensor would never be seen (silently stale results). Update the "
        "existing tensor in place in a splitting op, pass it as an argument, or use cudagraph_mode='none'.\n"
        "Dynamo's code for this forward (the store is marked >>>):\n" + "\n".join(lines))
