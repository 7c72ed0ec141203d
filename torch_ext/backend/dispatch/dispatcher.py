"""Guard-free dispatch: after Dynamo compiles a forward, call the bytecode it produced directly.

    compiled = torch_ext.compile(model, CompileConfig(..., guard_free_dispatch=True))
    compiled(x, ...)     # 1st call: torch.compile (fullgraph) compiles; a bytecode hook records the
                         #   transformed code of `forward`, the backend the graph's inputs
    compiled(x, ...)     # later calls: one generated check of the call's signature (signature.py),
                         #   then that code runs as a plain Python function; Dynamo's guards are
                         #   not consulted

The check (a few us; docs/measurements/host-cost.md) covers what the compiled code assumed about the arguments: tensor
dtypes, devices, ranks, requires_grad, the sizes and strides Dynamo specialized (a first call at
batch 1 specializes the batch dim to 1), equalities between symbolic sizes, the ints it specialized,
other Python scalars, container structure, other objects by identity, and the global state Dynamo
guards (grad mode, autocast).
A call that does not match goes through torch.compile with its guards: Dynamo compiles code for it
(its automatic dynamic shapes make a dim that changed symbolic), and that code is armed too
(newest first, up to 8 variants). One GuardFreeDispatchWarning per kind of mismatch says why.

The root module's training flag (`train()` / `eval()`) and its own plain attributes (ints, floats,
bools, strings: `self.scale = 2.0`) are checked too (module_state.py): a call after one changed goes
through torch.compile's guards (said once), which compile code for it where the forward reads it.
Calls from many threads are safe: they run one at a time in the process (runtime/serial_calls.py).

What Dynamo's guards would also check stays the caller's promise (the contract):
  * Other Python state the forward reads besides its arguments (submodules' attributes, a
    submodule switched to train()/eval() on its own, parameters and buffers reassigned, globals,
    config flags, attributes of an object argument passed again after it changed) keeps its
    value at the compile: it is frozen into the code.
  * Sizes along dims compiled as symbolic may take any value: the bounds Dynamo's shape guards put
    on them are not checked. Batch 1 runs the symbolic graph, which is valid for it (plain
    torch.compile would specialize it into another graph).
  * The forward compiles to one graph (fullgraph=True): no graph breaks.
  * nn.Module forward hooks do not run (the forward is called directly, as vLLM does).

The transformed code goes, decompiled by depyf, to <debug_dump_dir>/guard_free_<pid>_<name>.py
(later variants: <name>.<k>.py), headed by the generated check.

With CUDA graphs on (cudagraph_mode != "none"), whatever the dispatch: a forward that assigns a
module buffer or parameter (`self.buf = ...`) makes Dynamo's code store a new tensor into the
module after each call, while captured graphs keep reading the old one. The bytecode hook finds
that store in the transformed code and raises CudaGraphBufferMutationError showing it.
(In-place updates of module state are refused at graph level, see runtime/cudagraph/manager.CudaGraphManager.prepare.)
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
import types
import warnings
import weakref
from typing import Any, Callable

import torch
from torch import nn

from torch_ext import compat
from torch_ext.backend.dump import decompile
from torch_ext.backend.runtime import serial_calls
from torch_ext.backend.runtime.cudagraph.errors import CudaGraphError
from torch_ext.backend.warm_start import program as warm_program
from torch_ext.backend.warm_start.background import background_finder
from torch_ext.backend.warm_start.module import SavedStandIn
from torch_ext.backend.dispatch.module_state import ModuleState
from torch_ext.backend.dispatch.signature import CallSignature

log = logging.getLogger(__name__)

__all__ = ["GuardFreeDispatchWarning", "GuardFreeDispatcher", "forward_of"]

MAX_VARIANTS = 8  # armed codes per forward (Dynamo's own recompile_limit defaults to 8 as well)

_local = threading.local()  # the dispatcher whose call is going through torch.compile, in this thread
# Dynamo's transformed code -> the inputs of the graph compiled with it (for code Dynamo later serves
# to another dispatcher of the same forward from its cache).
_graph_inputs_of_code: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_hook_handle = None


def _ensure_hook() -> None:
    global _hook_handle
    if _hook_handle is None:
        _hook_handle = torch._dynamo.convert_frame.register_bytecode_hook(_record_transformed_code)


def _record_transformed_code(code: types.CodeType, new_code: types.CodeType):
    """Dynamo's transformed code of the forward a dispatcher is compiling in this thread."""
    dispatcher = getattr(_local, "dispatcher", None)
    if dispatcher is not None and code is dispatcher.code:
        dispatcher._new_code = new_code
        if dispatcher._graph_inputs is not None:
            _graph_inputs_of_code[new_code] = dispatcher._graph_inputs
    return None
class GuardFreeDispatchWarning(UserWarning):
    """A guard-free call did not match the code compiled so far and went through torch.compile."""


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
    """Calls a forward through torch.compile, then through Dynamo's transformed code directly for
    every call matching the signature that code was compiled for."""

    def __init__(self, model: nn.Module | Callable, backend: Callable, *, dynamic: bool | None = None,
                 debug_dir: str | None = None, warm_start: bool = False):
        func, self_arg = forward_of(model)
        if func is None:
            raise TypeError(f"guard-free dispatch needs an nn.Module, a method or a Python function, got {model!r}")
        self.model = model
        self.func = func
        self.code = func.__code__
        self.self_arg = self_arg
        self.debug_dir = debug_dir
        self.backend = backend
        self.compiled = torch.compile(model, backend=self._record_graph_inputs, dynamic=dynamic, fullgraph=True)
        self.signatures: list[CallSignature] = []  # of the armed variants, newest first
        # (check, code as a function, module state): replaced whole, never changed in place, so other
        # threads may read it while one arms a variant.
        self._variants: list[tuple[Callable[..., bool], Callable, ModuleState]] = []
        self._lock = threading.RLock()  # calls through torch.compile, one at a time (first calls of many threads)
        self._new_code: types.CodeType | None = None  # set by the bytecode hook during a guarded call
        self._graph_inputs: dict | None = None  # set by the backend during a guarded call
        self._noted: set = set()
        self.calls = 0  # calls that went through Dynamo (1 while every call matches the first)
        # Warm start (warm_start/program.py): a call no armed variant takes runs, and arms, a saved program.
        self.warm = warm_program.for_forward(model, func, self_arg, backend, dynamic) if warm_start else None
        self._warm_programs: tuple = ()  # loaded or traced by warm start, newest first
        self.background = background_finder(self.warm, model, backend.config)
        _ensure_hook()

    def __reduce__(self):  # pickled with a module whose forward it replaced (see SavedStandIn)
        return SavedStandIn, (self.func.__qualname__,)

    def __repr__(self) -> str:
        state = f"{len(self._variants)} armed" if self._variants else "not compiled yet"
        return f"GuardFreeDispatcher({self.func.__qualname__}, {state})"

    @torch.compiler.disable  # an outer torch.compile calls it as is, never traces into it
    def __call__(self, *args, **kwargs):
        # Compiled calls one at a time in the process, from the check on (runtime/serial_calls.py):
        # threads waiting here leave the GIL to the call, which would otherwise lose it at every
        # torch op. Calls through the guards (compiles) run outside it: a cold compile of one model
        # does not stall another's calls.
        serial_calls.ready_thread()
        stale = None  # the newest variant the call fits but the module's state does not (same mode first)
        with serial_calls.LOCK:
            for check, fast, state in self._variants:
                if check(*args, **kwargs):
                    if state.matches():
                        return fast(*args, **kwargs)
                    if stale is None or (stale.changed()[:1] == ("training",) and state.changed()[:1] != ("training",)):
                        stale = state
        return self._guarded_call(args, kwargs, stale=stale)

    def __getattr__(self, name: str) -> Any:  # reach the module's attributes, as OptimizedModule does
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def _record_graph_inputs(self, gm, example_inputs):
        """The backend torch.compile calls: records what the graph takes from the call, then compiles."""
        inputs = compat.graph_inputs_by_source(gm)
        compiled = self.backend(gm, example_inputs)
        self._graph_inputs = inputs  # only once compiled: Dynamo may restart an attempt
        return compiled

    def _guarded_call(self, args, kwargs, stale: ModuleState | None = None):
        with self._lock:
            if stale is not None:
                self._note(("state", stale.changed()), "torch_ext: guard-free dispatch of %s: %s since the "
                           "compile; this call goes through torch.compile's guards, which compile code for it "
                           "where the forward reads it", self.func.__qualname__, stale.difference(), warn=True)
            return self._guarded_call_locked(args, kwargs, stale)

    def _guarded_call_locked(self, args, kwargs, stale: ModuleState | None):
        if self.warm is not None:  # a program saved by an earlier process (or traced now and saved) for this call
            # The saved guards first: a program armed for other calls may take this one too (an argument
            # object the signature checks by identity, generate's new cache; a value it checks exactly).
            program = next((p for p in self._warm_programs if p.accepts(args, kwargs)), None)
            if program is None and self.background is not None and self.background.eligible():
                program, eager, found = self.background.find(args, kwargs, self._warm_programs)
                self._warm_programs = tuple(found) + self._warm_programs
                if eager:  # its program is on its way: run the forward meanwhile
                    return self.background.run_eagerly(args, kwargs)
            if program is None:
                program, loaded = self.warm.find(args, kwargs, self._warm_programs)
                self._warm_programs = tuple(loaded) + self._warm_programs
            if program is not None:
                out = program(args, kwargs)
                self._arm(args, kwargs, ready=(program.fast, program.graph_inputs, program.function.__code__))
                return out
        if self.signatures:
            self._warn_mismatch(args, kwargs)
        self.calls += 1
        self._new_code = self._graph_inputs = None
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
        if stale is not None and self._new_code is None:
            # No new compile. With one cache entry, Dynamo's guards took the code compiled before (it
            # does not read what changed): calls with the new state may run it. Otherwise which code
            # ran is unknown: such calls keep going through the guards.
            if len(torch._dynamo.eval_frame._debug_get_cache_entry_list(self.code)) == 1:
                self._variants = [(c, f, ModuleState(self.self_arg) if st is stale else st)
                                  for c, f, st in self._variants]
            self._graph_inputs = None
            return out
        self._arm(args, kwargs)
        return out

    def _warn_mismatch(self, args, kwargs) -> None:
        # What the variant the call got furthest with (the newest among equals) says, unless said already.
        mismatches = [m for m in (s.explain(args, kwargs) for s in self.signatures) if m is not None]
        mismatches.sort(key=lambda m: -m.progress)
        mismatch = next((m for m in mismatches if (m.kind, m.subject) not in self._noted), None)
        if mismatch is None:
            return
        self._noted.add((mismatch.kind, mismatch.subject))
        hint = {
            "size": " To compile one graph for all sizes, mark the dim dynamic before the first call "
                    "(torch._dynamo.mark_dynamic(tensor, dim)) and make that call with a size of at least 2: "
                    "Dynamo specializes sizes 0 and 1.",
            "value": " Dynamo specialized this argument to its value; after this recompile it is symbolic where "
                     "Dynamo can make it so (automatic dynamic).",
            "state": " Make every call in the state of the first (e.g. always under torch.no_grad()).",
            "object": " Pass a dataclass (its fields are checked), or the object's tensors and ints as arguments.",
        }.get(mismatch.kind, "")
        warnings.warn(f"torch_ext: guard-free dispatch of {self.func.__qualname__}: {mismatch.message}. This call goes "
                      f"through torch.compile with guards; Dynamo compiles code for it where they fail, and later "
                      f"calls like it run that code without guards.{hint}", GuardFreeDispatchWarning, stacklevel=4)

    def _arm(self, args, kwargs, ready: tuple[Callable, dict, types.CodeType] | None = None) -> None:
        """Arm the code of the call just compiled, or `ready`: (a function to call, its graph inputs, its code)."""
        code, inputs = self._new_code, self._graph_inputs
        self._new_code = self._graph_inputs = None
        if ready is not None:
            code = None
            inputs = ready[1]
        elif code is None:
            # Dynamo ran code compiled before: for another instance of this forward (served from its
            # cache on a first call), or code this dispatcher did not arm (its check is stricter).
            if self._variants:
                self._note(("guarded",), "torch_ext: guard-free dispatch of %s: a call ran through torch.compile's "
                           "guards without a new compile; calls like it keep doing so", self.func.__qualname__)
                return
            entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(self.code)
            if len(entries) != 1:
                self._note(("no code",), "torch_ext: guard-free dispatch could not find the code Dynamo generated "
                           "for %s; calls keep going through torch.compile (with guards).", self.func.__qualname__,
                           warn=True)
                return
            code = entries[0].code
            inputs = _graph_inputs_of_code.get(code)  # None: every size checked as in this call
        if code is not None and code.co_freevars != self.code.co_freevars:
            self._note(("freevars",), "torch_ext: guard-free dispatch could not use the code Dynamo generated "
                       "for %s; calls go through torch.compile (with guards)", self.func.__qualname__, warn=True)
            return
        if len(self._variants) >= MAX_VARIANTS and ready is not None:
            # A saved program's guards took the call (generate passes a new cache object per call of
            # generate, checked by identity here): the oldest variant makes room.
            self._note(("replace",), "torch_ext: guard-free dispatch of %s has armed %d variants; the oldest is "
                       "replaced by each new one a saved program's guards accept", self.func.__qualname__, MAX_VARIANTS)
            self._variants, self.signatures = self._variants[:-1], self.signatures[:-1]
        if len(self._variants) >= MAX_VARIANTS:
            self._note(("limit",), "torch_ext: guard-free dispatch of %s has armed %d variants; calls matching none "
                       "go through torch.compile (with guards)", self.func.__qualname__, MAX_VARIANTS, warn=True)
            return
        try:
            signature = CallSignature(self.func, self.self_arg, args, kwargs, inputs)
        except Exception as e:  # an argument we cannot describe: guards keep checking such calls
            self._note(("signature",), "torch_ext: guard-free dispatch of %s cannot check calls like this one "
                       "(%s: %s); they go through torch.compile (with guards)", self.func.__qualname__,
                       type(e).__name__, e, warn=True)
            return
        if not signature.check(*args, **kwargs):  # e.g. an argument the call itself changed
            self._note(("unmatched",), "torch_ext: guard-free dispatch of %s: a compiled call does not match its own "
                       "signature (%s); it is not armed", self.func.__qualname__, signature.explain(args, kwargs))
            return
        if ready is not None:
            fast = ready[0]
        else:
            fn = types.FunctionType(code, self.func.__globals__, self.func.__name__, self.func.__defaults__,
                                    self.func.__closure__)
            fn.__kwdefaults__ = self.func.__kwdefaults__
            fast = functools.partial(fn, self.self_arg) if self.self_arg is not None else fn
        self._variants = [(signature.check, fast, ModuleState(self.self_arg)), *self._variants]
        self.signatures.insert(0, signature)
        if self.debug_dir:
            self._dump(code if code is not None else ready[2], signature, len(self._variants) - 1)
        log.info("torch_ext: guard-free dispatch armed variant %d of %s", len(self._variants), self.func.__qualname__)

    def _note(self, key, msg: str, *args, warn: bool = False) -> None:
        if key in self._noted:
            return
        self._noted.add(key)
        if warn:
            warnings.warn(msg % args, GuardFreeDispatchWarning, stacklevel=5)
        else:
            log.info(msg, *args)

    def _dump(self, code: types.CodeType, signature: CallSignature, index: int) -> None:
        os.makedirs(self.debug_dir, exist_ok=True)
        suffix = f".{index}" if index else ""
        path = os.path.join(self.debug_dir, f"guard_free_{os.getpid()}_{self.func.__name__}{suffix}.py")
        check = "\n".join("#     " + line for line in signature.source.splitlines())
        header = (f"# The code torch_ext's guard-free dispatch runs for {self.func.__qualname__} "
                  f"({self.code.co_filename}:{self.code.co_firstlineno}),\n"
                  "# Dynamo's transformed bytecode of one compile, decompiled by depyf, for the calls this\n"
                  f"# check accepts:\n{check}\n")
        try:
            with open(path, "w") as f:
                f.write(header + decompile(code))
        except OSError as e:
            log.warning("torch_ext: cannot write %s: %s", path, e)


def forward_of(model) -> tuple[Callable | None, Any]:
    """(function, self) of what torch.compile traces for `model`; (None, None) for other callables."""
    if isinstance(model, nn.Module):
        bound = model.forward
        if inspect.ismethod(bound):
            return bound.__func__, bound.__self__
    elif inspect.ismethod(model):
        return model.__func__, model.__self__
    elif isinstance(model, types.FunctionType):
        return model, None
    return None, None
