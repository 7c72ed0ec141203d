"""Programs found off the caller's thread (`CompileConfig(background_compile=True)`): a serving
process answers its first calls at once.

A call that no program at hand accepts, made with autograd off, runs the forward eagerly on its own
thread while the process's one compile thread finds its program (WarmStart.find: loaded from the
cache dir, else traced through AOT compile, compiled and saved). Calls of that kind keep running
eagerly until the program is ready; the first call after that runs it, and CUDA graphs are captured
there, on the caller's thread, never on the compile thread. While it compiles, the compile thread
leaves the model's parameters as they are (merged projections bind at the first call of the
program), holds Dynamo's compile lock (compiles of other threads wait), and times kernels under the
process lock where it comes within a second (process_lock.py).

Why one compile thread: Dynamo's and Inductor's config is process-wide and patched during a compile;
compiles one at a time keep each in its own, as in the foreground. Calls that record autograd
(training) compile in the foreground as before: the optimizer changes the parameters the trace reads.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import queue
import sys
import threading
import time
import types
import warnings
from typing import Callable

import torch

from torch_ext import compat, process_lock
from torch_ext.backend.counters import counters
from torch_ext.backend.warm_start.program import availability, call_shape

log = logging.getLogger("torch_ext.backend.warm_start")

_jobs: "queue.Queue[_Job]" = queue.Queue()
_unfinished = 0  # jobs submitted and not done; wait_compiled() waits for 0
_state = threading.Condition()
_worker: threading.Thread | None = None
_process_interval = sys.getswitchinterval()


class _Job:
    def __init__(self, finder: "BackgroundFinder", args: tuple, kwargs: dict, at_hand: tuple):
        self.finder = finder
        # The eager run of this very call changes its arguments meanwhile (a cache fills its lazily made
        # tensors): the trace reads them as they were at the call.
        memo: dict[int, object] = {}
        self.args, self.kwargs = _snapshot(args, memo), _snapshot(kwargs, memo)
        self.at_hand = at_hand
        self.inference = torch.is_inference_mode_enabled()
        self.device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self.submitted = time.perf_counter()
        self.done = False
        self.collected = False  # its programs were handed to the dispatcher
        self.programs: list = []  # loaded or traced on the way (the one for this call among them)

    def run(self) -> None:
        grad = torch.inference_mode() if self.inference else torch.no_grad()
        device = torch.cuda.device(self.device) if self.device is not None else contextlib.nullcontext()
        # Dynamo's compile lock, as its own compiles hold it (AOT compile does not take it): a compile of
        # another thread waits instead of sharing the process-wide configs. After the entry's lock,
        # the order a foreground call takes them in.
        with process_lock.background(), grad, device, self.finder.warm.lock, compat.compile_lock():
            found, self.programs = self.finder.warm.find(self.args, self.kwargs, self.at_hand)
        self.args = self.kwargs = self.at_hand = None  # the call's tensors (a cache) are not held longer
        seconds = time.perf_counter() - self.submitted
        if found is not None:
            log.info("torch_ext: %s: program ready on the compile thread %.2f s after the first call of its "
                     "kind; calls like it run it from now on", self.finder.warm.name, seconds)
        else:
            self.finder.warm.say("background none", "no program for a call on the compile thread (%.2f s); "
                                 "such calls go through torch.compile", seconds, level=logging.WARNING)


def background_finder(warm, model, config) -> "BackgroundFinder | None":
    """The BackgroundFinder of a forward torch_ext.compile serves, where config.background_compile asks
    for one; where warm start is off (torch without AOT compile) a warning says the calls compile in
    the foreground."""
    if not config.background_compile:
        return None
    if warm is None:
        why = availability(config) or "warm start is off"
        warnings.warn(f"torch_ext: CompileConfig.background_compile=True, but {why}: calls compile in the "
                      "foreground (the compile thread traces through warm start's AOT compile)", UserWarning,
                      stacklevel=3)
        return None
    return BackgroundFinder(warm, model)


class BackgroundFinder:
    """The background side of one forward's WarmStart: which calls run eagerly, and the programs its
    jobs found. Called by the forward's dispatcher under its lock (one caller at a time)."""

    def __init__(self, warm, eager: Callable):
        self.warm = warm
        self.eager = eager  # the forward itself, uncompiled
        self._jobs: dict[tuple, _Job] = {}  # by kind of call: (shapes, dtypes, types, grad mode)

    @staticmethod
    def eligible() -> bool:
        """Calls that record no autograd and run with no mode, autocast or functorch transform (thread
        state the compile thread lacks)."""
        return not torch.is_grad_enabled() and compat.no_modes_or_autocast_active()

    def find(self, args: tuple, kwargs: dict, at_hand: tuple) -> tuple:
        """(the program found since the last look that accepts this call or None, whether the call runs
        eagerly: its program is on its way, every program found since the last look). None and False:
        the call goes the foreground way."""
        found = self._collect()
        program = next((p for p in found if p.accepts(args, kwargs)), None)
        if program is not None:
            return program, False, found
        kind = (call_shape(args, kwargs), torch.is_inference_mode_enabled())
        job = self._jobs.get(kind)
        if job is None:
            job = self._jobs[kind] = _Job(self, args, kwargs, at_hand)
            self.warm.say("background", "a call of a kind with no program runs eagerly while its program is "
                          "loaded or compiled on a background thread (CompileConfig.background_compile); "
                          "torch_ext.wait_compiled() waits for it")
            _submit(job)
        if job.done:
            return None, False, found
        counters.background_eager_calls += 1
        return None, True, found

    def run_eagerly(self, args: tuple, kwargs: dict):
        # Not under the process lock: an eager forward may compile a region of its own (Dynamo's compile
        # lock, held by the compile thread meanwhile); a compiled call's runners take it themselves.
        return self.eager(*args, **kwargs)

    def _collect(self) -> list:
        out = []
        for job in self._jobs.values():
            if job.done and not job.collected:
                job.collected = True
                out.extend(job.programs)
        return out


_SHARED = (torch.Tensor, torch.nn.Module, type, types.FunctionType, types.MethodType, types.ModuleType,
           types.BuiltinFunctionType, int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)


def _snapshot(value, memo: dict, depth: int = 0):
    """`value` as it is now, for a trace that runs while the caller's eager run changes it: lists,
    tuples, dicts and plain objects copied with their attributes as they are, anything else (tensors,
    modules, functions, objects that do not copy) shared. Aliasing is kept. What a wrong snapshot
    costs is speed only: the saved guards check every call against the real arguments."""
    if isinstance(value, _SHARED) or depth > 8:
        return value
    if id(value) in memo:
        return memo[id(value)]
    kind = type(value)
    if kind in (list, tuple) or (kind.__base__ is tuple and hasattr(kind, "_fields")):
        items = [_snapshot(v, memo, depth + 1) for v in value]
        out = list(items) if kind is list else tuple(items) if kind is tuple else kind(*items)
    elif kind is dict:
        out = {k: _snapshot(v, memo, depth + 1) for k, v in value.items()}
    elif hasattr(value, "__dict__") and not callable(value):
        try:
            out = copy.copy(value)
        except Exception:  # a lock, a handle: shared
            return value
        memo[id(value)] = out
        for name, attribute in vars(value).items():
            copied = _snapshot(attribute, memo, depth + 1)
            if copied is not attribute:
                try:
                    vars(out)[name] = copied
                except TypeError:
                    pass
        return out
    else:
        return value
    memo[id(value)] = out
    return out


def _submit(job: _Job) -> None:
    global _unfinished, _worker, _process_interval
    with _state:
        if _unfinished == 0:  # the interval to put back once the compile thread is idle again
            _process_interval = sys.getswitchinterval()
        _unfinished += 1
        # The compile thread traces (make_fx; Inductor's symbolic_trace) while callers run the model
        # eagerly: fx's patches of nn.Module.__call__ must not reach their threads (idempotent).
        compat.confine_fx_patches_to_their_thread()
        if _worker is None or not _worker.is_alive():
            _worker = threading.Thread(target=_work, name="torch_ext compile", daemon=True)
            _worker.start()
    _jobs.put(job)


# How long the compile thread may keep the GIL from a thread that asks for it. Every torch op releases
# the GIL, and taking it back from a thread running Python waits out this interval: at CPython's 5 ms an
# eager prefill of a 16-layer Llama took 4.2 s beside a compile instead of 0.9 s (H200). Set while jobs
# run, then put back.
SWITCH_INTERVAL = 5e-5


def _work() -> None:
    global _unfinished
    while True:
        job = _jobs.get()
        before = sys.getswitchinterval()  # the process's own, or ours where the previous job left it set
        sys.setswitchinterval(min(before, SWITCH_INTERVAL))
        ours = sys.getswitchinterval()  # as CPython rounds it
        try:
            job.run()
        except BaseException as e:  # the next call of its kind compiles in the foreground and raises there
            log.warning("torch_ext: %s: the background compile failed (%s: %s); the next call of its kind "
                        "compiles in the foreground", job.finder.warm.name, type(e).__name__, e)
            job.args = job.kwargs = job.at_hand = None
        finally:
            if _jobs.empty() and sys.getswitchinterval() == ours:
                sys.setswitchinterval(_process_interval)
            counters.background_compiles += 1
            job.done = True
            with _state:
                _unfinished -= 1
                _state.notify_all()


def wait_compiled(timeout: float | None = None) -> bool:
    """Wait until every program queued for the compile thread is ready (or failed); False if `timeout`
    seconds passed first."""
    with _state:
        return _state.wait_for(lambda: _unfinished == 0, timeout)
