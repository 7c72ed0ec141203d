"""Declare a Python function as an opaque op the torch_ext backend splits graphs at.

    from torch_ext.hops.splitting_op import splitting_op

    @splitting_op("mylib::attention", mutates_args=("kv_cache",),
                  fake=lambda q, k, v, kv_cache: torch.empty_like(q))
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        ...

    cfg = torch_ext.CompileConfig(splitting_ops=[attention])     # or ["mylib::attention"]

Under the hood this is `torch.library.custom_op` plus `register_fake`: Dynamo records one opaque
call, the backend runs it eagerly between compiled pieces, and it may mutate its inputs in place
(say so in `mutates_args`). The fake implementation tells the compiler the output's shape and
dtype without running the op; an op returning None needs none.
"""
from __future__ import annotations

import inspect
import re
from typing import Any, Callable, Iterable

import torch

__all__ = ["splitting_op", "declared_splitting_ops"]

_QUALNAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*::[A-Za-z_][A-Za-z0-9_]*$")
_declared: list[str] = []


def declared_splitting_ops() -> tuple[str, ...]:
    """Names of the ops declared with `splitting_op` in this process, in declaration order."""
    return tuple(_declared)


def splitting_op(
    qualname: str,
    *,
    mutates_args: Iterable[str] = (),
    fake: Callable[..., Any] | None = None,
    device_types: str | Iterable[str] | None = None,
) -> Callable[[Callable[..., Any]], Any]:
    """Decorator: turn `fn` (type-annotated, like torch.library.custom_op wants) into the op
    `qualname` ("namespace::name"); returns the op, callable like `fn`."""
    if not isinstance(qualname, str) or not _QUALNAME.match(qualname):
        raise ValueError(f"splitting_op: {qualname!r} is not a name of the form 'namespace::name', "
                         "e.g. 'mylib::attention'")
    if isinstance(mutates_args, str):
        raise TypeError(f"splitting_op({qualname!r}): mutates_args takes a tuple of argument names, "
                        f"e.g. mutates_args=({mutates_args!r},)")
    mutates = tuple(mutates_args)

    def decorate(fn: Callable[..., Any]):
        params = inspect.signature(fn).parameters
        unknown = [name for name in mutates if name not in params]
        if unknown:
            raise ValueError(f"splitting_op({qualname!r}): mutates_args names {unknown}, which "
                             f"{fn.__name__} does not take (its arguments: {list(params)})")
        returns = inspect.signature(fn).return_annotation
        returns_none = returns is None or returns == "None"
        if fake is None and not returns_none:
            raise TypeError(
                f"splitting_op({qualname!r}): {fn.__name__} returns {returns!r}, so the compiler needs a "
                "fake implementation giving the output's shape and dtype: pass fake=..., e.g. "
                "fake=lambda q, k, v, kv_cache: torch.empty_like(q)")
        try:
            op = torch.library.custom_op(qualname, mutates_args=mutates, device_types=device_types)(fn)
        except Exception as e:
            raise type(e)(f"splitting_op({qualname!r}): torch.library.custom_op refused {fn.__name__}: {e}") from e
        op.register_fake(fake if fake is not None else _returns_none(fn))
        _declared.append(qualname)
        return op

    return decorate


def _returns_none(fn: Callable[..., Any]) -> Callable[..., None]:
    def fake(*args, **kwargs) -> None:
        return None

    fake.__signature__ = inspect.signature(fn)  # register_fake checks the signature matches
    return fake
