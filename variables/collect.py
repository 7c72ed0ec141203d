"""Find every VariableTracker reachable from a HOP body's output, with the path that reaches it.

A body may return any Python structure: containers, user objects, dataclasses (frozen too),
namedtuples, closures. Only the tensor and SymNode VTs inside it become subgraph outputs; the paths
(`out.cache[2].meta`) are for error messages.

Attributes set on objects created inside the body are not in the VT itself: Dynamo keeps them in
`side_effects.store_attr_mutations`, so the walk reads them from there too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from torch._dynamo.variables.base import VariableTracker
from torch._dynamo.variables.lazy import LazyVariableTracker


@dataclass(frozen=True)
class Found:
    path: str
    vt: VariableTracker


def _key_repr(key: Any) -> str:
    # ConstDictVariable keys are hashable wrappers around a VT.
    vt = getattr(key, "vt", key)
    try:
        return repr(vt.as_python_constant())
    except Exception:
        return type(vt).__name__


def _children(vt: VariableTracker, attr_mutations: dict) -> Iterator[tuple[str, Any]]:
    """(path suffix, child) pairs of one VT: attributes set during tracing first (they are what user
    code reads, so they name the path), then the VT's own fields."""
    for attr, value in attr_mutations.get(vt, {}).items():
        yield f".{attr}", value
    for name, value in vars(vt).items():
        if name in vt._nonvar_fields:
            continue
        if name == "items" and isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                yield f"[{i}]", item
        elif name == "items" and isinstance(value, dict):
            for key, item in value.items():
                yield f"[{_key_repr(key)}]", item
        elif name == "fields" and isinstance(value, dict):  # frozen dataclass fields
            for field, item in value.items():
                yield f".{field}", item
        else:
            yield f".{name}", value


def walk(tx, output: VariableTracker, root: str = "out") -> Iterator[Found]:
    """Yield every realized VT reachable from `output`, each once, depth first, in field order."""
    attr_mutations = tx.output.side_effects.store_attr_mutations
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [(root, output)]
    keep_alive = []  # ids stay unique only while the objects live
    while stack:
        path, value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        keep_alive.append(value)
        children: list[tuple[str, Any]]
        if isinstance(value, LazyVariableTracker):
            if not value.is_realized():
                continue  # never touched by the body: an outer value, nothing to output
            value = value.unwrap()
        if isinstance(value, VariableTracker):
            yield Found(path, value)
            children = [(path + suffix, child) for suffix, child in _children(value, attr_mutations)]
        elif isinstance(value, (list, tuple)):
            children = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        elif isinstance(value, dict):
            children = [(f"{path}[{_key_repr(k)}]", v) for k, v in value.items()]
        else:
            continue
        stack.extend(reversed(children))
