"""Guard-free dispatch: after Dynamo's first compile of a forward, call the bytecode it produced directly.

    compiled = torch_ext.compile(model, CompileConfig(..., guard_free_dispatch=True))
    compiled(x, ...)     # 1st call: torch.compile (fullgraph) compiles; a bytecode hook records the
                         #   transformed code of `forward`
    compiled(x, ...)     # later calls: that code runs as a plain Python function; Dynamo and its
                         #   guards are not consulted

What Dynamo's guards would check is then the caller's promise (the contract):
  * The first call is representative: every later call takes the same code path, with the same
    dtypes, devices, grad mode and Python values the forward reads (module attributes, globals,
    config flags). They are frozen at their first-call values; no recompile ever happens.
  * Sizes vary only along dims the first compile made dynamic. Mark the batch dim with
    torch._dynamo.mark_dynamic (or compile with dynamic=True) and make the first call with a batch
    of at least 2: Dynamo specializes sizes 0 and 1, and a specialized graph would then serve every
    batch. Later calls at batch 1 run the symbolic graph, which is valid for it.
  * The forward compiles to one graph (fullgraph=True): no graph breaks.
  * nn.Module forward hooks do not run (the forward is called directly, as vLLM does).

The transformed code goes, decompiled by depyf, to <debug_dump_dir>/guard_free_<pid>_<name>.py.

With CUDA graphs on (cudagraph_mode != "none"), whatever the dispatch: a forward that assigns a
module buffer or parameter (`self.buf = ...`) makes Dynamo's code store a new tensor into the
module after each call, while captured graphs keep reading the old one. The bytecode hook finds
that store in the transformed code and raises CudaGraphBufferMutationError showing it.
(In-place updates of module state are refused at graph level, see cudagraph.CudaGraphManager.prepare.)
"""
from __future__ import annotations

import dis
import functools
import inspect
import io
import logging
import os
import threading
import types
import warnings
from typing import Any, Callable

import torch
from torch import nn

from torch_ext.backend.cudagraph import CudaGraphBufferMutationError, CudaGraphError

log = logging.getLogger(__name__)

__all__ = ["GuardFreeDispatcher", "buffer_assignments", "compile", "expect_transformed_code"]

_local = threading.local()  # the dispatcher whose first call is compiling, in this thread
_hook_handle = None
# (compile id, what) for frames in which a backend with CUDA graphs compiled a graph; the hook for
# the same compile checks the frame's code (entries of aborted compiles are dropped).
_pending_checks: list[tuple[Any, str]] = []

_STATE_DICTS = ("_buffers", "_parameters")


def _ensure_hook() -> None:
    global _hook_handle
    if _hook_handle is None:
        _hook_handle = torch._dynamo.convert_frame.register_bytecode_hook(_bytecode_hook)


def expect_transformed_code(what: str) -> None:
    """Called by a backend with CUDA graphs while Dynamo compiles a frame: check that frame's code."""
    _pending_checks.append((torch._guards.CompileContext.current_compile_id(), what))
    _ensure_hook()


def _bytecode_hook(code: types.CodeType, new_code: types.CodeType):
    dispatcher = getattr(_local, "dispatcher", None)
    if dispatcher is not None and code is dispatcher.code and dispatcher.transformed is None:
        dispatcher.transformed = new_code
    if _pending_checks:
        current = torch._guards.CompileContext.current_compile_id()
        mine = [what for compile_id, what in _pending_checks if compile_id == current]
        _pending_checks.clear()
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


def decompile(code: types.CodeType) -> str:
    """Python source for Dynamo's transformed code (depyf), or its disassembly where depyf can't."""
    try:
        import depyf

        return depyf.decompile(code)
    except Exception as e:  # depyf missing, or a bytecode it does not know
        out = io.StringIO()
        dis.dis(code, file=out)
        return f"# depyf could not decompile this code ({type(e).__name__}: {e}); disassembly follows\n" + \
            "\n".join("# " + line for line in out.getvalue().splitlines())


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


def _unwrap(e: BaseException) -> BaseException:
    """Our error, if Dynamo wrapped one (BackendCompilerFailed, InternalTorchDynamoError)."""
    seen = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, CudaGraphError):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__ or getattr(cause, "inner_exception", None)
    return e


class GuardFreeDispatcher:
    """Calls a forward through torch.compile once, then through Dynamo's transformed code directly."""

    def __init__(self, model: nn.Module | Callable, backend: Callable, *, dynamic: bool | None = None,
                 debug_dir: str | None = None):
        if isinstance(model, nn.Module):
            bound = model.forward
            func, self_arg = bound.__func__, bound.__self__
        elif inspect.ismethod(model):
            func, self_arg = model.__func__, model.__self__
        elif isinstance(model, types.FunctionType):
            func, self_arg = model, None
        else:
            raise TypeError(f"guard-free dispatch needs an nn.Module, a method or a Python function, got {model!r}")
        self.model = model
        self.func = func
        self.code = func.__code__
        self.self_arg = self_arg
        self.debug_dir = debug_dir
        self.compiled = torch.compile(model, backend=backend, dynamic=dynamic, fullgraph=True)
        self.transformed: types.CodeType | None = None
        self._fast: Callable | None = None
        self.calls = 0  # calls that went through Dynamo (1 once dispatch is armed)
        _ensure_hook()

    def __repr__(self) -> str:
        state = "armed" if self._fast is not None else "not compiled yet"
        return f"GuardFreeDispatcher({self.func.__qualname__}, {state})"

    def __call__(self, *args, **kwargs):
        fast = self._fast
        if fast is not None:
            return fast(*args, **kwargs)
        return self._first_call(args, kwargs)

    def __getattr__(self, name: str) -> Any:  # reach the module's attributes, as OptimizedModule does
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def _first_call(self, args, kwargs):
        self.calls += 1
        _local.dispatcher = self
        try:
            out = self.compiled(*args, **kwargs)
        except Exception as e:
            ours = _unwrap(e)
            if ours is e:
                raise
            raise ours from None  # its message says it all; Dynamo's wrapper only adds noise
        finally:
            _local.dispatcher = None
        self._arm()
        return out

    def _arm(self) -> None:
        code = self.transformed
        if code is None:
            # Dynamo may have served the first call from a cache entry compiled for another instance.
            entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(self.code)
            if len(entries) == 1:
                code = entries[0].code
        if code is None or code.co_freevars != self.code.co_freevars:
            warnings.warn(f"torch_ext: guard-free dispatch could not find the code Dynamo generated for "
                          f"{self.func.__qualname__}; calls keep going through torch.compile (with guards).")
            self._fast = self.compiled
            return
        fn = types.FunctionType(code, self.func.__globals__, self.func.__name__, self.func.__defaults__,
                                self.func.__closure__)
        fn.__kwdefaults__ = self.func.__kwdefaults__
        self._fast = functools.partial(fn, self.self_arg) if self.self_arg is not None else fn
        if self.debug_dir:
            self._dump(code)
        log.info("torch_ext: guard-free dispatch armed for %s", self.func.__qualname__)

    def _dump(self, code: types.CodeType) -> None:
        os.makedirs(self.debug_dir, exist_ok=True)
        path = os.path.join(self.debug_dir, f"guard_free_{os.getpid()}_{self.func.__name__}.py")
        header = (f"# The code torch_ext's guard-free dispatch runs for {self.func.__qualname__} "
                  f"({self.code.co_filename}:{self.code.co_firstlineno}),\n"
                  "# Dynamo's transformed bytecode of the first compile, decompiled by depyf.\n")
        try:
            with open(path, "w") as f:
                f.write(header + decompile(code))
        except OSError as e:
            log.warning("torch_ext: cannot write %s: %s", path, e)


def compile(model, config=None, *, dynamic: bool | None = None):
    """torch.compile with the torch_ext backend; with config.guard_free_dispatch, a GuardFreeDispatcher."""
    from torch_ext.backend import make_backend

    backend = make_backend(config)
    if not backend.config.guard_free_dispatch:
        return torch.compile(model, backend=backend, dynamic=dynamic)
    return GuardFreeDispatcher(model, backend, dynamic=dynamic, debug_dir=backend.config.debug_dump_dir)
