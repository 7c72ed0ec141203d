"""What `torch_ext.compile` returns with warm start and no guard-free dispatch (`WarmStartModule`: the
programs first, torch.compile for calls none takes), and what a compiled forward pickles as
(`SavedStandIn`). The programs themselves, found, loaded or traced: program.py."""
from __future__ import annotations

import threading
from typing import Any

import torch

from torch_ext.backend.counters import counters
from torch_ext.backend.warm_start.background import background_finder
from torch_ext.backend.warm_start.program import Program, WarmStart

_EAGER = object()  # _find's answer for a call that runs eagerly while its program is on its way


class SavedStandIn:
    """What a torch_ext-compiled forward becomes when something that holds it is pickled: Dynamo's
    saved guard state keeps a module's callable attributes, and `model.forward = torch_ext.compile(
    model.forward)` puts the wrapper (with its backend, locks and graphs) in the module's __dict__.
    The saved guards never call it."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"SavedStandIn({self.name})"

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"torch_ext: {self.name} was compiled in another process; compile it again here")


class WarmStartModule:
    """torch_ext.compile's result with warm start (without guard-free dispatch): calls the first
    program (saved or just traced) whose guards accept the call; a call none accepts looks for its
    entry (WarmStart.find), else goes through the torch.compile'd model."""

    def __init__(self, model, compiled, warm: WarmStart):
        self.model = model
        self.compiled = compiled  # torch.compile(model, backend=...): traces only for calls no program takes
        self.warm = warm
        self.background = background_finder(warm, model, warm.backend.config)
        self.programs: tuple[Program, ...] = ()  # newest first; replaced whole (other threads read it)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"WarmStartModule({self.warm.name}, {len(self.programs)} programs)"

    @torch.compiler.disable  # an outer torch.compile (transformers' generate compiles __call__) calls it as is
    def __call__(self, *args, **kwargs):
        for program in self.programs:
            if program.accepts(args, kwargs):
                return program(args, kwargs)
        program = self._find(args, kwargs)
        if program is _EAGER:  # its program is on its way (background.py): run the forward meanwhile
            return self.background.run_eagerly(args, kwargs)
        if program is not None:
            return program(args, kwargs)
        counters.warm_start_fallbacks += 1
        return self.compiled(*args, **kwargs)

    def _find(self, args, kwargs) -> Program | None:
        with self._lock:  # calls of many threads: one loads or traces, the others wait for it
            for program in self.programs:  # another thread may have found it meanwhile
                if program.accepts(args, kwargs):
                    return program
            if self.background is not None and self.background.eligible():
                program, eager, found = self.background.find(args, kwargs, self.programs)
                self.programs = tuple(found) + self.programs
                if program is not None or eager:
                    return program or _EAGER
            found, loaded = self.warm.find(args, kwargs, self.programs)
            self.programs = tuple(reversed(loaded)) + self.programs
            if found is None and self.programs:
                self.warm.say("fallback", "a call no saved program accepts goes through torch.compile (said once)")
            return found

    def __reduce__(self):
        return SavedStandIn, (self.warm.name,)

    def __getattr__(self, name: str) -> Any:  # reach the module's attributes, as OptimizedModule does
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)
