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

`autograd=False` declares an inference-only op, registered straight with the dispatcher (as vLLM's
direct_register_custom_op does): under no_grad a call adds about 7 us to calling the function
where custom_op's Python autograd, view-tracking and alias-checking layers add 14-23 us, and under
inference_mode 3 us where custom_op adds 6 (`python bench/dev/splitting_op_cost.py`, 2-core CPU);
piecewise CUDA graphs pay that for every splitting op of every step. Such an op refuses inputs
that require grad while grad mode is on (no gradient can be silently lost) and bumps the version
counters of the tensors it mutates, as custom_op does.
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
    autograd: bool = True,
) -> Callable[[Callable[..., Any]], Any]:
    """Decorator: turn `fn` (type-annotated, like torch.library.custom_op wants) into the op
    `qualname` ("namespace::name"); returns the op, callable like `fn` (a CustomOpDef, which takes
    `register_autograd`; with autograd=False the `torch.ops` overload packet)."""
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
        fake_fn = fake if fake is not None else _returns_none(fn)
        if autograd:
            try:
                op = torch.library.custom_op(qualname, mutates_args=mutates, device_types=device_types)(fn)
            except Exception as e:
                raise type(e)(f"splitting_op({qualname!r}): torch.library.custom_op refused {fn.__name__}: {e}") from e
            op.register_fake(fake_fn)
        else:
            op = _register_inference_op(qualname, fn, mutates, device_types, fake_fn)
        _declared.append(qualname)
        return op

    return decorate


_libraries: list[torch.library.Library] = []  # registrations live as long as their Library object


def _register_inference_op(qualname: str, fn: Callable[..., Any], mutates: tuple[str, ...],
                           device_types: str | Iterable[str] | None, fake: Callable[..., Any]):
    namespace, name = qualname.split("::")
    try:
        schema = torch.library.infer_schema(fn, mutates_args=mutates)
        lib = torch.library.Library(namespace, "FRAGMENT")
        lib.define(name + schema)
    except Exception as e:
        raise type(e)(f"splitting_op({qualname!r}, autograd=False): could not define the op from "
                      f"{fn.__name__}: {e}") from e
    _libraries.append(lib)
    if device_types is None:
        lib.impl(name, fn, "CompositeExplicitAutograd")
    else:
        for device_type in [device_types] if isinstance(device_types, str) else device_types:
            lib.impl(name, fn, torch._C._dispatch_key_for_device(device_type))
    packet = getattr(getattr(torch.ops, namespace), name)
    overload = packet.default
    params = list(inspect.signature(fn).parameters)
    mutated = [(params.index(arg), arg) for arg in mutates]

    def inference_kernel(*args, **kwargs):
        """At the Autograd key: check, then dispatch below autograd (fake tensors, functionalization
        and other modes come after this key, so the op must go back through the dispatcher)."""
        if torch.is_grad_enabled():
            for a in _tensors((*args, *kwargs.values())):
                if a.requires_grad:
                    raise RuntimeError(
                        f"{qualname} was declared with splitting_op(..., autograd=False) (inference only), "
                        "but an input requires grad while grad mode is on, and the op has no gradient. Run "
                        "it under torch.no_grad() or torch.inference_mode(), or declare it with "
                        "autograd=True and register a formula with op.register_autograd(...).")
        for i, arg in mutated:
            for t in _tensors((args[i] if i < len(args) else kwargs.get(arg),)):
                if not t.is_inference():
                    torch.autograd.graph.increment_version(t)
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return overload(*args, **kwargs)

    lib.impl(name, inference_kernel, "Autograd")
    torch.library.register_fake(qualname, fake, lib=lib)
    return packet


def _tensors(values) -> list[torch.Tensor]:
    """The tensors among values, including those inside list arguments (schema Tensor[])."""
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(t for t in v if isinstance(t, torch.Tensor))
    return found


def _returns_none(fn: Callable[..., Any]) -> Callable[..., None]:
    def fake(*args, **kwargs) -> None:
        return None

    fake.__signature__ = inspect.signature(fn)  # register_fake checks the signature matches
    return fake
