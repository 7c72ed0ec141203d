"""What a warm-start entry is keyed on and checked against (warm_start/program.py): descriptions of the call,
the model and the environment that are stable across processes."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import os
import re

import torch

from torch_ext import compat
from torch_ext.backend.compile.cache import _file_digest

_PLAIN = (int, float, bool, str, type(None))


def rooted_at(guard_name: str, names: list[str]) -> bool:
    """Whether a guard's source expression ("x.__class__", "type(x).f", "L['x']") reads one of `names`."""
    return any(re.search(rf"(^|[(\[']){re.escape(n)}\b", guard_name) for n in names)


def through_class(guard_name: str) -> bool:
    """Whether a guard's source reaches its object through a class (`type(x)...`, `x.__class__...`,
    `...__mro__...`): a method or property of the class, not something the caller passed."""
    return bool(re.search(r"(^|[(\[.])type\(|__class__|__mro__", guard_name))


def tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors(item)


def module_tensors(module: torch.nn.Module):
    yield from module.parameters()
    yield from module.buffers()


def spec(value) -> str:
    """What the key holds of an argument: tensor metadata (no sizes: guards check those), types."""
    if isinstance(value, torch.Tensor):
        marks = {a: getattr(value, a) for a in compat.DIM_MARKING_ATTRS if hasattr(value, a)}
        return (f"T({value.dtype},{value.device},{value.dim()},{value.requires_grad},"
                f"{value.is_inference()},{sorted((k, repr(v)) for k, v in marks.items())})")
    if isinstance(value, (list, tuple)):
        return f"{type(value).__qualname__}[{','.join(spec(v) for v in value)}]"
    if isinstance(value, dict):
        return f"dict{{{','.join(f'{k!r}:{spec(v)}' for k, v in value.items())}}}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ",".join(f"{f.name}={spec(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{type(value).__qualname__}({fields})"
    return type(value).__qualname__


def model_digest(self_arg) -> str:
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


def config_digest(self_arg) -> str:
    """The model's config object where it has one with `to_dict()` (Hugging Face's PretrainedConfig):
    values the forward reads from it are guarded, but a program is not worth loading for another config."""
    to_dict = getattr(getattr(self_arg, "config", None), "to_dict", None)
    if not callable(to_dict):
        return ""
    try:
        return hashlib.sha256(_stable_repr(to_dict()).encode()).hexdigest()
    except Exception as e:  # a config that cannot describe itself: the guards alone decide
        return f"unavailable ({type(e).__name__})"


@functools.lru_cache(maxsize=32)
def library_version(module_name: str) -> str:
    """The installed version of the distribution a forward's top-level package comes from
    (transformers 5.17.0): a program traced under another version is not loaded."""
    import importlib.metadata

    top = module_name.partition(".")[0]
    try:
        return f"{top}=={importlib.metadata.version(top)}"
    except importlib.metadata.PackageNotFoundError:
        return top  # a local module: its source digest decides


def dynamo_config_digest() -> str:
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


def package_digest() -> str:
    """torch_ext's own source (its VariableTrackers shape the traced graph): the torch_ext, variables
    and hops directories, by file name and content."""
    stamp = []
    for package in ("torch_ext", "torch_ext.variables", "torch_ext.hops"):  # their files, not their code
        for directory, _, files in os.walk(os.path.dirname(importlib.util.find_spec(package).origin)):
            for file in files:
                if file.endswith(".py"):
                    path = os.path.join(directory, file)
                    st = os.stat(path)
                    stamp.append((path, st.st_mtime_ns, st.st_size))
    return _package_digest_cached(tuple(sorted(stamp)))
