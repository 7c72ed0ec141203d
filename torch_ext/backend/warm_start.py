"""Warm start: a new process runs the program `torch_ext.compile` traced before, without Dynamo.

At the first call of a forward compiled with `torch_ext.compile(model, config)` (config.warm_start,
a cache_dir, torch with AOT compile: compat.HAS_AOT_COMPILE), the call is described by an entry
key; an entry under that key in `<cache_dir>/warm_start/` is loaded, else the forward is traced
once through torch's AOT compile (compat.aot_compile) and the entry written for the next process.

What an entry holds: Dynamo's transformed bytecode and its guards (torch's AOTCompiledFunction,
serialized), the Dynamo graph with its fake example values and the directory key of its pieces
(warm_graph.SavedGraph: loading runs the backend on that graph again, every piece a disk-cache
hit), the dim markings of the argument tensors, and the digest of every file Dynamo traced.

The key holds what decides the trace or the pieces' directory: torch/Python/Triton/CUDA versions
and hardware (environment.py), torch_ext's own source, torch_ext's and Dynamo's config, the
backend config's artifact hash, the forward (qualified name and its file's digest), the model's
structure (modules, parameter and buffer shapes/dtypes/devices, plain attributes, training flags),
and the call: tensor dtypes, devices, ranks, requires_grad, dim markings; Python argument types;
grad/inference mode and `dynamic`. On load the traced files are checked against their digests,
the data against its sha256 (cache.py), torch's SystemInfo against this process; every call runs
the saved code only if the saved guards accept it (shapes, dtypes, module attributes Dynamo read;
guards on globals are not saved: globals the forward reads are frozen, as under guard-free
dispatch). Anything else goes through torch.compile, said in one log line.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import logging
import os
import pickle
import time
from typing import Any

import torch

import torch_ext
from torch_ext import compat
from torch_ext.backend import warm_graph
from torch_ext.backend.cache import ArtifactStore, _file_digest
from torch_ext.backend.counters import counters
from torch_ext.backend.environment import process_factors

log = logging.getLogger(__name__)

FORMAT = "torch_ext warm start v1"
STORE = "warm_start"  # <cache_dir>/warm_start/{artifacts,locks,tmp}: one ArtifactStore
_PLAIN = (int, float, bool, str, type(None))


def availability(config) -> str | None:
    """None when warm start is on for this config, else why not."""
    if config.warm_start is False:
        return "CompileConfig.warm_start=False"
    if not config.cache_dir:
        return "no cache_dir"
    if not compat.HAS_AOT_COMPILE:
        return f"torch {torch.__version__} has no AOT compile of Dynamo programs (torch 2.13+ does)"
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


class Program:
    """A traced program (loaded or just compiled): Dynamo's code, callable without Dynamo."""

    def __init__(self, aot, self_arg):
        self.aot = aot
        self.self_arg = self_arg
        self.function = aot.fn  # the transformed forward; takes `self` first for a method
        self.graph_inputs = aot._artifacts.compiled_fn.graph_inputs

    def mismatch(self, args: tuple, kwargs: dict) -> str | None:
        """Why the saved guards refuse this call, or None."""
        if self.self_arg is not None:
            args = (self.self_arg,) + args
        return compat.aot_guard_reason(self.aot, args, kwargs)

    def __call__(self, args: tuple, kwargs: dict):
        if self.self_arg is not None:
            return self.function(self.self_arg, *args, **kwargs)
        return self.function(*args, **kwargs)


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

    def say(self, key: str, msg: str, *args, level: int = logging.INFO) -> None:
        """One log line per kind of event."""
        if key not in self._said:
            self._said.add(key)
            log.log(level, "torch_ext warm start of %s: " + msg, self.name, *args)

    def program(self, args: tuple, kwargs: dict) -> Program | None:
        """The program for this (first) call: loaded, or traced and saved; None: use torch.compile."""
        try:
            name, factors = self.entry_key(args, kwargs)
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
                    found = self._compile_and_save(store, name, factors, args, kwargs)
        if isinstance(found, Program):
            log.info("torch_ext warm start of %s: ready in %.2f s", self.name, time.perf_counter() - start)
            return found
        return None

    # -- the key ------------------------------------------------------------------------------------

    def entry_key(self, args: tuple, kwargs: dict) -> tuple[str, dict[str, str]]:
        config = self.backend.config
        devices = {t.device.type for t in _tensors((args, kwargs))}
        if isinstance(self.model, torch.nn.Module):
            devices |= {t.device.type for t in _module_tensors(self.model)}
        factors = {
            "format": FORMAT,
            "torch_ext": _package_digest(),
            "torch_ext_config": repr(torch_ext.config.checkpoint_side_effects),
            "dynamo_config": _dynamo_config_digest(),
            "backend_config": config.artifact_hash(),
            "forward": f"{self.func.__module__}.{self.func.__qualname__} "
                       f"{_file_digest(self.func.__code__.co_filename)}",
            "model": _model_digest(self.self_arg),
            "inputs": _spec((args, kwargs)),
            "mode": f"grad={torch.is_grad_enabled()} inference={torch.is_inference_mode_enabled()} "
                    f"dynamic={self.dynamic}",
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
        token = warm_graph.loading_backend.set(self.backend)
        try:
            aot = compat.aot_deserialize(entry["aot"], self.func.__globals__, entry["marks"])
            program = Program(aot, self.self_arg)
        except Exception as e:
            store.discard(name, f"cannot be loaded: {type(e).__name__}: {e}")
            return None
        finally:
            warm_graph.loading_backend.reset(token)
        counters.warm_start_loads += 1
        return program

    # -- trace and save -----------------------------------------------------------------------------

    def _compile_and_save(self, store: ArtifactStore, name: str, factors: dict, args: tuple, kwargs: dict):
        try:
            aot, traced = compat.aot_compile(self.func, self.self_arg, args, kwargs,
                                             warm_graph.backend_for_save(self.backend), dynamic=self.dynamic)
        except Exception as e:
            reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            self.say("refused", "cannot trace it for a warm start (%s); it goes through torch.compile", reason)
            _write(store, name, {"format": FORMAT, "factors": factors, "refused": reason})
            return "refused"
        if self.backend.config.cudagraph_mode != "none":
            from torch_ext.backend.dispatch import buffer_assignments

            if buffer_assignments(compat.aot_transformed_code(aot)):
                return "refused"  # torch.compile's bytecode hook raises the error that shows the store
        program = Program(aot, self.self_arg)
        arguments = inspect.signature(self.func).bind(*(((self.self_arg,) if self.self_arg is not None else ())
                                                       + args), **kwargs).arguments
        sources = {path: _file_digest(path) for path in set(compat.aot_traced_files(traced)) if os.path.exists(path)}
        try:
            entry = {"format": FORMAT, "factors": factors, "sources": sources, "cpu_vec_isa": compat.cpu_vec_isa_names(),
                     "marks": warm_graph.tensor_marks(arguments), "aot": compat.aot_serialize(aot)}
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


# -- key factors ----------------------------------------------------------------------------------

def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _module_tensors(module: torch.nn.Module):
    yield from module.parameters()
    yield from module.buffers()


def _spec(value) -> str:
    """What the key holds of an argument: tensor metadata (no sizes: guards check those), types."""
    if isinstance(value, torch.Tensor):
        marks = {a: getattr(value, a) for a in compat.DIM_MARKING_ATTRS if hasattr(value, a)}
        return (f"T({value.dtype},{value.device},{value.dim()},{value.requires_grad},"
                f"{value.is_inference()},{sorted((k, repr(v)) for k, v in marks.items())})")
    if isinstance(value, (list, tuple)):
        return f"{type(value).__qualname__}[{','.join(_spec(v) for v in value)}]"
    if isinstance(value, dict):
        return f"dict{{{','.join(f'{k!r}:{_spec(v)}' for k, v in value.items())}}}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ",".join(f"{f.name}={_spec(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{type(value).__qualname__}({fields})"
    return type(value).__qualname__


def _model_digest(self_arg) -> str:
    """The model's structure: modules, their plain attributes and training flags, the metadata of
    parameters and buffers (their values are read at run time, not frozen)."""
    if not isinstance(self_arg, torch.nn.Module):
        return type(self_arg).__qualname__
    h = hashlib.sha256()
    for name, module in self_arg.named_modules(remove_duplicate=False):
        plain = sorted((k, repr(v)) for k, v in vars(module).items() if not k.startswith("_") and isinstance(v, _PLAIN))
        h.update(f"{name}:{type(module).__module__}.{type(module).__qualname__}:{plain}\n".encode())
    for kind, items in (("p", self_arg.named_parameters(remove_duplicate=False)),
                        ("b", self_arg.named_buffers(remove_duplicate=False))):
        for name, t in items:
            h.update(f"{kind}{name}:{tuple(t.shape)}:{t.stride()}:{t.dtype}:{t.device}:{t.requires_grad}\n".encode())
    return h.hexdigest()


def _dynamo_config_digest() -> str:
    """Dynamo's config (values whose repr is stable across processes: no object addresses)."""
    items = []
    for key, value in sorted(torch._dynamo.config.get_config_copy().items()):
        text = _stable_repr(value)
        if not key.startswith("_") and " at 0x" not in text:
            items.append(f"{key}={text}")
    return hashlib.sha256("\n".join(items).encode()).hexdigest()


def _stable_repr(value) -> str:
    """repr, with sets and dicts in sorted order (string hashing differs between processes)."""
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_stable_repr(v) for v in value)) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(sorted(f"{_stable_repr(k)}: {_stable_repr(v)}" for k, v in value.items())) + "}"
    if isinstance(value, (list, tuple)):
        return type(value).__name__ + "(" + ", ".join(_stable_repr(v) for v in value) + ")"
    return repr(value)


@functools.lru_cache(maxsize=8)
def _package_digest_cached(stamp: tuple) -> str:
    h = hashlib.sha256()
    for path, _, _ in stamp:
        h.update(f"{os.path.basename(path)} {_file_digest(path)}\n".encode())
    return h.hexdigest()


def _package_digest() -> str:
    """torch_ext's own source (its VariableTrackers shape the traced graph): the torch_ext, variables
    and hops directories, by file name and content."""
    import torch_ext.hops
    import torch_ext.variables

    stamp = []
    for package in (torch_ext, torch_ext.variables, torch_ext.hops):
        for directory, _, files in os.walk(os.path.dirname(package.__file__)):
            for file in files:
                if file.endswith(".py"):
                    path = os.path.join(directory, file)
                    st = os.stat(path)
                    stamp.append((path, st.st_mtime_ns, st.st_size))
    return _package_digest_cached(tuple(sorted(stamp)))


class WarmStartModule:
    """torch_ext.compile's result with warm start (without guard-free dispatch): calls the saved or
    just traced program where its guards accept the call, else the torch.compile'd model."""

    def __init__(self, model, compiled, warm: WarmStart):
        self.model = model
        self.compiled = compiled  # torch.compile(model, backend=...): traces on its first call only
        self.warm = warm
        self.program_: Program | None = None
        self._tried = False

    def __repr__(self) -> str:
        return f"WarmStartModule({self.warm.name}, {'program ready' if self.program_ else 'no program'})"

    def __call__(self, *args, **kwargs):
        if not self._tried:
            self._tried = True
            self.program_ = self.warm.program(args, kwargs)
        program = self.program_
        if program is not None:
            reason = program.mismatch(args, kwargs)
            if reason is None:
                return program(args, kwargs)
            counters.warm_start_fallbacks += 1
            self.warm.say("mismatch", "a call the saved program was not traced for (%s) goes through "
                          "torch.compile (said once)", reason)
        return self.compiled(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # reach the module's attributes, as OptimizedModule does
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)
