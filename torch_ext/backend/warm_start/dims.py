"""Which dims of a call to trace dynamic for a warm-start dynamic entry: those that differ from the
call its static entry served, as Dynamo's automatic dynamic does after a recompile. Tracing every
dim dynamic instead (dynamic=True) makes head counts and cache lengths symbolic too: slower kernels,
and CUDA graphs cannot pad such a graph (each of its shapes has more than the batch size free)."""
from __future__ import annotations

import contextlib

import torch

_DEPTH = 4  # generate's StaticCache holds its tensors two objects down (cache.layers[i].keys)


def tensors(args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    """The tensors of a call by path, through tuples, lists, dicts and plain objects' attributes."""
    found: dict[str, torch.Tensor] = {}

    def walk(value, path: str, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            found.setdefault(path, value)
        elif depth >= _DEPTH or isinstance(value, (str, bytes, torch.nn.Module)):
            return
        elif isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                walk(item, f"{path}[{i}]", depth + 1)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}[{key!r}]", depth + 1)
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            for key, item in vars(value).items():
                walk(item, f"{path}.{key}", depth + 1)

    walk(tuple(args), "args", 0)
    walk(kwargs, "kwargs", 0)
    return found


def shapes(args: tuple, kwargs: dict) -> dict[str, tuple[int, ...]]:
    return {path: tuple(t.shape) for path, t in tensors(args, kwargs).items()}


def differing(base: dict[str, tuple[int, ...]], args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, int]]:
    """(tensor, dim) of this call whose size differs from the same tensor's in `base`."""
    out = []
    for path, t in tensors(args, kwargs).items():
        old = base.get(path)
        if old is not None and len(old) == t.dim():
            out += [(t, d) for d, (a, b) in enumerate(zip(old, t.shape)) if a != b]
    return out


@contextlib.contextmanager
def marked_dynamic(marks: list[tuple[torch.Tensor, int]]):
    """maybe_mark_dynamic on each (tensor, dim) while tracing, then the tensors' marks as they were
    (they are the user's: a cache kept for later calls)."""
    with weak_marks_kept([t for t, _ in marks]):
        for t, d in marks:
            torch._dynamo.maybe_mark_dynamic(t, d)
        yield


@contextlib.contextmanager
def weak_marks_kept(tensors: list[torch.Tensor]):
    """The tensors' weak dynamic marks (maybe_mark_dynamic) as they were before, afterwards. Also around
    a training program's call: AOTAutograd marks each tensor it saves for backward with its dynamic dims
    (runtime_wrappers.maybe_mark_dynamic_helper), the caller's input among them; a call's entry key holds
    the marks, so a later lookup with that tensor would find no entry and trace another."""
    saved = [(t, getattr(t, "_dynamo_weak_dynamic_indices", None)) for t in tensors]
    try:
        yield
    finally:
        for t, old in saved:
            if old is None:
                if hasattr(t, "_dynamo_weak_dynamic_indices"):
                    del t._dynamo_weak_dynamic_indices
            else:
                t._dynamo_weak_dynamic_indices = old
