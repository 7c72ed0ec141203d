"""`Pass`: the base class of a post-grad graph pass, with a stable identity for the compile cache.

A pass rewrites the post-grad FX graph Inductor hands to `post_grad_custom_post_pass` (functional
ATen, every node with a FakeTensor in `meta["val"]`). Its `uuid()` hashes:

- the source of every `Pass` subclass in its MRO (so editing the pass, or this base, changes it),
- the source of the objects listed in `source_dependencies` (helpers, custom ops, pattern modules),
- `config()`, the settings that change what the pass does.

Nothing else goes in (no ids, no addresses), so the same code and settings give the same uuid in
every process: an unchanged pass keeps cache hits, a changed one misses.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
from abc import abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

__all__ = ["Pass", "source_hash"]


class Pass(CustomGraphPass):
    """A post-grad pass over a `torch.fx.Graph`, run in order by `PassManager`.

    Subclasses implement `__call__(graph)`; they override `is_applicable` to run only for some
    compile sizes and `config` when constructor arguments change their behaviour.
    """

    #: Modules, classes or functions (besides the pass's own classes) whose source decides what the
    #: pass does; their source goes into `uuid()`.
    source_dependencies: ClassVar[tuple[Any, ...]] = ()

    @abstractmethod
    def __call__(self, graph: torch.fx.Graph) -> None:
        """Rewrite `graph` in place; leave it valid (`graph.lint()` passes)."""

    def is_applicable(self, compile_size: int | None) -> bool:
        """Whether to run for this compile: an int is a size-specialized compile, None the
        general (symbolic-shape) one."""
        return True

    def config(self) -> Mapping[str, Any]:
        """Settings that change the pass's behaviour, JSON-serializable; part of `uuid()`."""
        return {}

    @property
    def name(self) -> str:
        return type(self).__qualname__

    def uuid(self) -> str:
        try:
            config = json.dumps(dict(self.config()), sort_keys=True)
        except TypeError as e:
            raise TypeError(
                f"{self.name}.config() must be JSON-serializable (it goes into the cache key): {e}"
            ) from e
        h = hashlib.sha256()
        h.update(_class_source_hash(type(self)).encode())
        h.update(config.encode())
        return h.hexdigest()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{self.name}({args})"


@functools.cache
def source_hash(obj: Any) -> str:
    """sha256 of the source of a module, class or function; a clear error when there is none.

    Read once per object: a file edited under a running process does not change its identity."""
    try:
        src = inspect.getsource(obj)
    except (OSError, TypeError) as e:
        raise RuntimeError(
            f"cannot read the source of {obj!r} to build a pass uuid; define it in a file, "
            "or override uuid()"
        ) from e
    return hashlib.sha256(src.encode()).hexdigest()


@functools.cache
def _class_source_hash(cls: type) -> str:
    parts = [source_hash(c) for c in cls.__mro__ if isinstance(c, type) and issubclass(c, Pass)]
    seen: set[int] = set()
    for c in cls.__mro__:
        for dep in vars(c).get("source_dependencies", ()):
            if id(dep) not in seen:
                seen.add(id(dep))
                parts.append(source_hash(dep))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()
