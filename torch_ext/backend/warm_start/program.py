"""Warm start: a new process runs the program `torch_ext.compile` traced before, without Dynamo.

At the first call of a forward compiled with `torch_ext.compile(model, config)` (config.warm_start,
a cache_dir, torch with AOT compile: compat.HAS_AOT_COMPILE), the call is described by an entry
key; an entry under that key in `<cache_dir>/warm_start/` is loaded, else the forward is traced
once through torch's AOT compile (compat.aot_compile) and the entry written for the next process.

What an entry holds: Dynamo's transformed bytecode and its guards (torch's AOTCompiledFunction,
serialized), the Dynamo graph with the fake values the backend reads and the directory key of its pieces
(saved_graph.SavedGraph: loading runs the backend on that graph again, every piece a disk-cache
hit), the dim markings of the argument tensors, and the digest of every file Dynamo traced.

The key holds what decides the trace or the pieces' directory: torch/Python/Triton/CUDA versions
and hardware (environment.py), torch_ext's own source, torch_ext's and Dynamo's config, the
backend config's artifact hash, the forward (qualified name and its file's digest), the model's
structure (modules, parameter and buffer shapes/dtypes/devices, plain attributes, training flags),
and the call: tensor dtypes, devices, ranks, requires_grad, dim markings; Python argument types;
grad/inference mode and `dynamic`. On load the traced files are checked against their digests,
the data against its sha256 (cache.py), torch's SystemInfo against this process; every call runs
the saved code only if the saved guards accept it (shapes, dtypes, module attributes Dynamo read;
guards on globals are not saved: the plain values Dynamo guarded globals on, a flag or a scale, are
saved and checked by value instead, GlobalValues). Anything else goes through torch.compile, said in one log line.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import logging
import os
import pickle
import threading
import time
import types
from typing import Any

import torch

from torch_ext import config as torch_ext_config
from torch_ext import compat
from torch_ext.backend.warm_start import dims
from torch_ext.backend.warm_start import key as warm_key
from torch_ext.backend.warm_start import saved_graph
from torch_ext.backend.runtime.cudagraph.buffer_stores import buffer_assignments
from torch_ext.backend.compile.cache import ArtifactStore, _file_digest
from torch_ext.backend.counters import counters
from torch_ext.backend.compile.environment import process_factors

log = logging.getLogger("torch_ext.backend.warm_start")  # the name docs/guide/troubleshooting.md documents

FORMAT = "torch_ext warm start v1"
STORE = "warm_start"  # <cache_dir>/warm_start/{artifacts,locks,tmp}: one ArtifactStore
MAX_PROGRAMS = 8  # entries one forward looks up per process (kinds of call x static/dynamic)
_IDENTITY_GUARDS = ("CLASS_MATCH", "CLOSURE_MATCH", "FUNCTION_MATCH")


def availability(config) -> str | None:
    """None when warm start is on for this config, else why not."""
    if config.warm_start is False:
        return "CompileConfig.warm_start=False"
    if not config.cache_dir:
        return "no cache_dir"
    if not compat.HAS_AOT_COMPILE:
        return f"torch {torch.__version__} has no AOT compile of Dynamo programs (torch 2.11+ does)"
    return None


def for_forward(model, func, self_arg, backend, dynamic) -> "WarmStart | None":
    """The WarmStart of a forward compiled by torch_ext.compile, or None when it is off (said once
    when the config asked for it)."""
    why_not = availability(backend.config)
    if why_not is not None:
        if backend.config.warm_start:
            log.warning("torch_ext: CompileConfig.warm_start=True, but %s: every process traces %s again.",
                        why_not, func.__qualname__)
        return None
    backend.warm_start_used = True
    return WarmStart(model, func, self_arg, backend, dynamic)


_CONSTANT_GUARDS = ("CONSTANT_MATCH", "EQUALS_MATCH")


def _plain_constant(value: Any) -> bool:
    if isinstance(value, (tuple, frozenset)):
        return all(_plain_constant(v) for v in value)
    return value is None or type(value) in (bool, int, float, str)


class GlobalValues:
    """The values of the forward's globals that Dynamo guarded on (a flag, a scale: `G['SCALE']`),
    as traced. Dynamo's guards on globals are not saved with the program, so these are checked
    instead, at every call: a global changed since the trace, in this process or in the one that
    saved it, makes the program refuse the call, which then goes through torch.compile (guarded)
    rather than running code traced with the old value."""

    def __init__(self, values: dict[str, Any], func_globals: dict):
        self.values = values
        self._getters = []
        for name, value in values.items():
            try:  # Dynamo's source name of a global: G['SCALE'], G['config'].flag
                getter = eval(compile(f"lambda G: {name}", "<torch_ext global guard>", "eval"), {})
                getter(func_globals)
            except Exception:  # a name made of Dynamo's helpers: left unchecked, as all were before
                continue
            self._getters.append((name, getter, value))
        self._globals = func_globals

    def changed(self) -> str | None:
        """The first global whose value is not the traced one, as a reason; None where none is."""
        for name, getter, value in self._getters:
            try:
                now = getter(self._globals)
            except Exception as e:
                return f"global {name} cannot be read ({type(e).__name__}); traced with {value!r}"
            if type(now) is not type(value) or now != value:
                return f"global {name} is {now!r}, traced with {value!r}"
        return None


class Program:
    """A traced program (loaded or just compiled): Dynamo's code, callable without Dynamo."""

    def __init__(self, aot, self_arg, global_values: GlobalValues | None = None):
        self.aot = aot
        self.self_arg = self_arg
        self.global_values = global_values
        self.function = aot.fn  # the transformed forward; takes `self` first for a method
        self.graph_inputs = compat.aot_backend_result(aot).graph_inputs
        # What runs a call (guard-free dispatch arms it): the forward with its self, and for a program of
        # calls that record autograd, the arguments' dim marks kept (dims.weak_marks_kept).
        fast = functools.partial(self.function, self_arg) if self_arg is not None else self.function
        self.fast = _keeping_marks(fast) if torch.is_grad_enabled() else fast

    def accepts(self, args: tuple, kwargs: dict) -> bool:
        """The per-call check (mismatch() builds the reason too: only where it is said)."""
        if self.global_values is not None and self.global_values.changed() is not None:
            return False
        if self.self_arg is not None:
            args = (self.self_arg,) + args
        return compat.aot_guard_accepts(self.aot, args, kwargs)

    def mismatch(self, args: tuple, kwargs: dict) -> str | None:
        """Why the saved guards refuse this call, or None."""
        reason = self.global_values.changed() if self.global_values is not None else None
        if reason is not None:
            return reason
        if self.self_arg is not None:
            args = (self.self_arg,) + args
        return compat.aot_guard_reason(self.aot, args, kwargs)

    def __call__(self, args: tuple, kwargs: dict):
        return self.fast(*args, **kwargs)


def _keeping_marks(fn):
    def call(*args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        with dims.weak_marks_kept(tensors):
            return fn(*args, **kwargs)
    return call


class WarmStart:
    """The warm-start entry of one forward: found, loaded or saved at the first call."""

    def __init__(self, model, func, self_arg, backend, dynamic):
        self.model = model
        self.func = func
        self.self_arg = self_arg
        self.backend = backend
        self.dynamic = dynamic
        self.name = func.__qualname__
        self._said: set[str] = set()
        self._load_failure: str | None = None  # why the entry found did not load (it is traced once more)
        self._tried: set[str] = set()  # entry names looked up (loaded, traced or refused) by this process
        self._refused = False  # an entry could not be traced: no more looking (each costs a key)
        # Shapes of calls that found no program: the key (the model's digest) is not computed again
        # for them on every call. Missing a program later costs speed only: torch.compile serves them.
        self._found_nothing: set = set()
        self._shapes: dict[str, dict] = {}  # static entry name -> tensor shapes of the call it served
        self.lock = threading.RLock()

    def say(self, key: str, msg: str, *args, level: int = logging.INFO) -> None:
        """One log line per kind of event."""
        if key not in self._said:
            self._said.add(key)
            log.log(level, "torch_ext warm start of %s: " + msg, self.name, *args)

    def find(self, args: tuple, kwargs: dict, at_hand: tuple[Program, ...] = ()) -> tuple[Program | None, list[Program]]:
        """For a call no program at hand accepts: (the program that accepts it or None: use
        torch.compile, every program loaded or traced on the way). A forward gets one entry per kind
        of call (the key holds the argument names, types, ranks: generate's prefill and decode are
        two); a call its kind's entry refuses (another prompt length) gets the kind's dynamic entry,
        traced with every dim dynamic, as Dynamo's automatic dynamic would after a recompile (unless
        `dynamic=False`). At most MAX_PROGRAMS entries per forward and process. `at_hand`: the
        programs the caller holds (none accepts this call)."""
        with self.lock:  # the compile thread (background.py) and callers' threads
            return self._find(args, kwargs, at_hand)

    def _find(self, args: tuple, kwargs: dict, at_hand: tuple[Program, ...]) -> tuple[Program | None, list[Program]]:
        if at_hand and "mismatch" not in self._said:  # the reason costs a verbose guard pass: build it once
            self.say("mismatch", "a call the saved program was not traced for (%s); looking for one traced for it",
                     at_hand[0].mismatch(args, kwargs))
        found, loaded = None, []
        if self._refused or len(self._tried) >= MAX_PROGRAMS:  # (each look costs a key: the model's digest)
            return found, loaded
        shape = call_shape(args, kwargs)
        if shape in self._found_nothing:
            return found, loaded
        static_name = None
        for dynamic in (self.dynamic, True) if self.dynamic is None else (self.dynamic,):
            try:
                name, factors = self.entry_key(args, kwargs, dynamic)
                static_name = name if dynamic is None else static_name
            except Exception as e:  # an argument the key cannot describe: torch.compile
                self.say("key", "cannot describe this call for the cache (%s: %s); it goes through torch.compile",
                         type(e).__name__, e, level=logging.WARNING)
                break
            if name in self._tried:
                continue
            if len(self._tried) >= MAX_PROGRAMS:
                self.say("limit", "%d saved programs in this process; calls none accepts go through "
                         "torch.compile", MAX_PROGRAMS, level=logging.WARNING)
                break
            self._tried.add(name)
            # The dynamic entry: the dims that differ from its static entry's call, where that call is known.
            base = self._shapes.get(static_name) if dynamic is True else None
            marks = dims.differing(base, args, kwargs) if base is not None else None
            program = self.program(args, kwargs, name, factors, dynamic, marks)
            if program is None:  # refused (a graph break, most often forward-wide) or unusable cache dir
                self._refused = True
                break
            loaded.append(program)
            reason = program.mismatch(args, kwargs)
            if reason is None:
                found = program
                if dynamic is None:
                    self._shapes[name] = dims.shapes(args, kwargs)
                break
            self.say("mismatch " + name, "a call the %s program was not traced for (%s)",
                     "dynamic" if dynamic else "saved", reason)
        if found is None and len(self._found_nothing) < 1024:
            self._found_nothing.add(shape)
        return found, loaded

    def program(self, args: tuple, kwargs: dict, name: str, factors: dict, dynamic: bool | None,
                marks: list | None = None) -> Program | None:
        """The program of entry `name`: loaded, or traced for this call and saved (with `marks`, the
        dims dims.differing found, dynamic; else as `dynamic` says); None: use torch.compile."""
        try:
            store = ArtifactStore(self.backend.config.cache_dir, STORE)
        except OSError as e:
            self.say("store", "cannot use the cache dir (%s); tracing through torch.compile", e,
                     level=logging.WARNING)
            return None
        start = time.perf_counter()
        found = self._load(store, name)
        if found is None:
            with store.lock(name):  # one process traces and saves; the others then load
                found = self._load(store, name, quiet=True)
                if found is None:
                    with dims.marked_dynamic(marks or []):
                        found = self._compile_and_save(store, name, factors, args, kwargs,
                                                       None if marks else dynamic)
        counters.warm_start_seconds += time.perf_counter() - start
        if isinstance(found, Program):
            log.info("torch_ext warm start of %s: ready in %.2f s", self.name, time.perf_counter() - start)
            return found
        return None

    # -- the key ------------------------------------------------------------------------------------

    def entry_key(self, args: tuple, kwargs: dict, dynamic: bool | None) -> tuple[str, dict[str, str]]:
        config = self.backend.config
        factors = {
            "format": FORMAT,
            "torch_ext": warm_key.package_digest(),
            "torch_ext_config": repr(torch_ext_config.checkpoint_side_effects),
            "dynamo_config": warm_key.dynamo_config_digest(),
            "backend_config": config.artifact_hash(),
            "forward": f"{self.func.__module__}.{self.func.__qualname__} "
                       f"{_file_digest(self.func.__code__.co_filename)}",
            "model": warm_key.model_digest(self.self_arg),
            "model_config": warm_key.config_digest(self.self_arg),
            "library": warm_key.library_version(self.func.__module__),
        }
        devices = {t.device.type for t in warm_key.tensors((args, kwargs))}
        if isinstance(self.model, torch.nn.Module):
            devices |= {t.device.type for t in warm_key.module_tensors(self.model)}
        factors |= {
            "inputs": warm_key.spec((args, kwargs)),
            "mode": f"grad={torch.is_grad_enabled()} inference={torch.is_inference_mode_enabled()} "
                    f"dynamic={dynamic}",
            **process_factors(devices, collectives=True),
        }
        digest = hashlib.sha256(repr(sorted(factors.items())).encode()).hexdigest()
        return digest, factors

    # -- load ---------------------------------------------------------------------------------------

    def _load(self, store: ArtifactStore, name: str, quiet: bool = False):
        """A Program, "refused" (this forward cannot be warm-started: use torch.compile), or None
        (nothing usable saved: trace it)."""
        blob = store.read(name)  # a damaged entry is reported and set aside there
        if blob is None:
            if not quiet:
                self.say("missing", "no saved program for this model, config and call; tracing it once "
                         "(saved in %s)", store.directory)
            return None
        try:
            entry = pickle.loads(blob)
            if entry.get("format") != FORMAT:
                raise ValueError(f"format {entry.get('format')!r}")
        except Exception as e:
            store.discard(name, f"cannot be read: {type(e).__name__}: {e}")
            return None
        if "refused" in entry:
            self.say("refused", "a previous trace could not be saved (%s); it goes through torch.compile. "
                     "Remove %s to try again.", entry["refused"], store.path(name))
            return "refused"
        changed = [path for path, digest in entry["sources"].items() if _file_digest(path) != digest]
        if changed:
            self.say("changed", "%s changed since the program was saved; tracing it again", changed[0])
            return None
        if entry.get("cpu_vec_isa") is not None:  # the pieces' C++ kernels: skip Inductor's ISA probe
            compat.prime_cpu_vec_isa(entry["cpu_vec_isa"])
        token = saved_graph.loading_backend.set(self.backend)
        try:
            aliases = {name: importlib.import_module(module) for name, module in entry["module_aliases"].items()}
            aot = compat.aot_deserialize(entry["aot"], {**self.func.__globals__, **aliases}, entry["marks"],
                                         self._external())
            program = Program(aot, self.self_arg, GlobalValues(entry.get("globals", {}), self.func.__globals__))
        except Exception as e:
            reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            store.discard(name, f"cannot be loaded: {reason}")
            if entry.get("retraced_after"):  # traced again once already: torch cannot load what it saves here
                _write(store, name, {"format": FORMAT, "refused": f"saved programs do not load ({reason})"})
                return "refused"
            self._load_failure = reason
            return None
        finally:
            saved_graph.loading_backend.reset(token)
        counters.warm_start_loads += 1
        return program

    # -- trace and save -----------------------------------------------------------------------------

    def _external(self) -> dict[str, Any]:
        """What the entry refers to instead of holding: the contents of the forward's closure (a
        decorated forward holds the undecorated function, which pickle cannot name). The next process
        has them from the same source (its digest is checked)."""
        return {f"closure {i}": cell.cell_contents for i, cell in enumerate(self.func.__closure__ or ())}

    def _guard_filter(self, entries) -> list[bool]:
        """Which of Dynamo's guards the entry keeps. Guards on globals go (they cannot be saved: the
        globals a forward reads are frozen, as under guard-free dispatch). So do guards on the
        identity of a class, function or code object reached from the model (its submodules' classes,
        their methods, closures of a decorated forward): in another process these are new objects
        made from the same source, which the entry checks instead (traced files' digests; the classes
        of the model's modules are in the key); guards on the forward's closure (the function a
        decorator wraps, its defaults) go for the same reason, and so do those on what an argument's class
        holds (`type(x).__mro__[1].__dict__['f'].fget`: a cache's property): the class itself is matched
        (TYPE_MATCH on the argument), its source by digest. An identity guard on an argument itself stays:
        passing another function must not run the saved code; it cannot be saved, so the entry is refused."""
        params = list(inspect.signature(self.func, follow_wrapped=False).parameters)
        arguments = params[1:] if self.self_arg is not None else params
        closure = list(self.func.__code__.co_freevars)  # a decorator's cells: the function it wraps
        keep = []
        for e in entries:
            if e.is_global and e.guard_type in _CONSTANT_GUARDS and e.has_value and _plain_constant(e.value):
                self._traced_globals[e.name] = e.value  # checked by value instead (GlobalValues)
            identity = e.guard_type in _IDENTITY_GUARDS or (e.guard_type == "CONSTANT_MATCH" and e.has_value
                                                             and isinstance(e.value, types.CodeType))
            on_argument = warm_key.rooted_at(e.name, arguments) and not warm_key.through_class(e.name)
            keep.append(not e.is_global and not (identity and not on_argument)
                        and not warm_key.rooted_at(e.name, closure))
        return keep

    def _compile_and_save(self, store: ArtifactStore, name: str, factors: dict, args: tuple, kwargs: dict,
                          dynamic: bool | None):
        self._traced_globals: dict[str, Any] = {}  # filled by _guard_filter while Dynamo traces
        try:
            aot, traced = compat.retrying_float_restarts(lambda: compat.aot_compile(
                self.func, self.self_arg, args, kwargs, saved_graph.backend_for_save(self.backend),
                dynamic=dynamic, guard_filter=self._guard_filter))
        except Exception as e:
            reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            # A forward Dynamo cannot capture whole (a graph break) is the user's to know of when asked for;
            # any other failure is torch_ext's or torch's, always worth a warning.
            asked = self.backend.config.warm_start is True
            level = logging.INFO if _dynamo_refusal(e) and not asked else logging.WARNING
            self.say("refused", "cannot trace it for a warm start (%s); it goes through torch.compile", reason,
                     level=level)
            _write(store, name, {"format": FORMAT, "factors": factors, "refused": reason})
            return "refused"
        if self.backend.config.cudagraph_mode != "none":
            if buffer_assignments(compat.aot_transformed_code(aot)):
                return "refused"  # torch.compile's bytecode hook raises the error that shows the store
        program = Program(aot, self.self_arg, GlobalValues(dict(self._traced_globals), self.func.__globals__))
        arguments = inspect.signature(self.func, follow_wrapped=False).bind(*(((self.self_arg,) if self.self_arg is not None else ())
                                                       + args), **kwargs).arguments
        sources = {path: _file_digest(path) for path in set(compat.aot_traced_files(traced)) if os.path.exists(path)}
        try:
            entry = {"format": FORMAT, "factors": factors, "sources": sources, "cpu_vec_isa": compat.cpu_vec_isa_names(),
                     "retraced_after": self._load_failure, "globals": program.global_values.values,
                     "module_aliases": compat.aot_module_aliases(aot, self.func.__globals__),
                     "marks": saved_graph.tensor_marks(arguments), "aot": compat.aot_serialize(aot, self._external())}
        except Exception as e:  # the program runs here; the next process traces again
            self.say("unsaved", "the traced program cannot be saved (%s: %s); the next process traces it again",
                     type(e).__name__, e, level=logging.WARNING)
            return program
        if _write(store, name, entry):
            counters.warm_start_saves += 1
        return program


def _write(store: ArtifactStore, name: str, entry: dict) -> bool:
    try:
        store.write(name, pickle.dumps(entry))
        return True
    except OSError as e:
        log.warning("torch_ext warm start: cannot write %s (%s)", store.path(name), e)
        return False


def call_shape(args: tuple, kwargs: dict) -> tuple:
    """What tells calls apart cheaply: tensors by shape, dtype and device, anything else by type."""
    def one(v):
        return (tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else type(v)
    return tuple(map(one, args)), tuple((k, one(v)) for k, v in sorted(kwargs.items()))


def _dynamo_refusal(e: BaseException) -> bool:
    """Dynamo refused the forward (a graph break, an unsupported construct), as opposed to failing."""
    from torch._dynamo import exc

    return isinstance(e, (exc.Unsupported, exc.UserError))
