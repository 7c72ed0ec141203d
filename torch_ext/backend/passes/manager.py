"""`PassManager`: runs the configured post-grad passes, in order, as Inductor's custom post pass.

The backend installs one per compile:

    torch._inductor.config.post_grad_custom_post_pass = PassManager(passes, compile_size=size)

and puts `uuid()` into its on-disk cache key. The uuid combines the compile size with the uuids of
the passes that run for that size, in order: editing, reconfiguring, adding, removing or reordering
a pass that runs changes it; a pass gated off for this size does not.

`then`: a user's own `post_grad_custom_post_pass` (CompileConfig.inductor_options; a pass, or a list of
them as newer torch takes), run after ours so that setting it never silently replaces them, nor they
it. Its uuid joins ours; where one has none (a plain function) so does the manager, and Inductor then
bypasses its FX-graph cache, as it would for that pass alone.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterable

import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from torch_ext.backend.config import inductor_option_key
from torch_ext.backend.passes.base import Pass, source_hash

__all__ = ["PassManager"]

log = logging.getLogger(__name__)


class PassManager(CustomGraphPass):
    def __init__(self, passes: Iterable[Pass] = (), compile_size: int | None = None, then=None) -> None:
        passes = tuple(passes)
        for p in passes:
            if not isinstance(p, Pass):
                raise TypeError(
                    f"PassManager takes Pass instances, got {type(p).__name__}: {p!r}"
                )
        if compile_size is not None and (
            isinstance(compile_size, bool) or not isinstance(compile_size, int)
        ):
            raise TypeError(f"compile_size must be an int or None, got {compile_size!r}")
        then = () if then is None else tuple(then) if isinstance(then, (list, tuple)) else (then,)
        for p in then:
            if not callable(p):
                raise TypeError(f"then takes callable post-grad passes (each is called with the FX graph), got {p!r}")
        self.passes = passes
        self.compile_size = compile_size
        self.then = then

    def applicable_passes(self) -> tuple[Pass, ...]:
        return tuple(p for p in self.passes if p.is_applicable(self.compile_size))

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.applicable_passes():
            start = time.perf_counter()
            try:
                p(graph)
                # A broken graph fails here, named after the pass that broke it, not later in lowering.
                graph.lint()
            except Exception as e:
                if hasattr(e, "add_note"):  # Python 3.11+
                    e.add_note(
                        f"in post-grad pass {p.name} (torch_ext PassManager, "
                        f"compile_size={self.compile_size})"
                    )
                raise
            log.debug(
                "post-grad pass %s took %.1f ms (compile_size=%s)",
                p.name,
                (time.perf_counter() - start) * 1e3,
                self.compile_size,
            )
        for p in self.then:
            p(graph)

    def uuid(self) -> str | None:
        then = [inductor_option_key(p) for p in self.then]
        if None in then:
            return None  # a user's pass without a key: nothing may be cached under ours
        key = {
            "manager": source_hash(type(self)),  # how passes are run is part of the result too
            "compile_size": self.compile_size,
            "passes": [p.uuid() for p in self.applicable_passes()],
            "then": then,
        }
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()

    def __repr__(self) -> str:
        then = f", then={list(self.then)!r}" if self.then else ""
        return f"PassManager({list(self.passes)!r}, compile_size={self.compile_size!r}{then})"
