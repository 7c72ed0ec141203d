"""The call signature Dynamo compiled a frame's code for, checked on every guard-free call.

`CallSignature(func, self_arg, args, kwargs, graph_inputs)` walks the arguments of the call the
code was compiled for (lists, tuples, dicts with str/int keys and dataclasses are followed) and
generates one Python function with the forward's parameters that says whether a later call may
run the same code:

  * tensors: dtype, device, rank, requires_grad and dispatch keys (inference tensors), and every
    size and stride Dynamo compiled as a constant (specialized dims, e.g. a batch of 1), in one
    C++ call (Dynamo's own TensorGuards); sizes Dynamo compiled as one symbol (duck sizing, e.g.
    two inputs with the same batch) must stay equal, sizes compiled as expressions of them
    (a contiguous stride) must still equal them;
  * Python scalars: ints Dynamo specialized, floats, bools, strings, None, enums, dtypes and devices
    by value; ints it made symbolic by type; containers by type and length (dicts: keys); other
    objects by identity (Dynamo may have specialized on anything it read from them);
  * the same tensor passed twice stays the same tensor, distinct tensors stay distinct objects;
  * global state Dynamo guards (grad mode, autocast, ...; Dynamo's GlobalStateGuard).

Not checked (the caller's promise, as before): module attributes, parameters and buffers, globals
and closures the forward reads, attributes of an object passed again after it changed, and the
bounds Dynamo's shape guards put on symbolic sizes (a symbolic size is accepted at any value, 1
included).

`graph_inputs` maps Dynamo's source names ("L['x']", "L['caches'][0]") to the fake values of the
graph's placeholders (compat.graph_inputs_by_source): a tensor or int the graph did not take as an
input is checked as it was at the compiled call (every size constant), which is always safe.
"""
from __future__ import annotations

import dataclasses
import enum
import inspect
import numbers
import re
import weakref
from typing import Any, Callable

import sympy
import torch

from torch_ext import compat

__all__ = ["CallSignature", "Mismatch"]

_CONSTANT_TYPES = (numbers.Number, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)  # by value


@dataclasses.dataclass
class _Condition:
    code: str  # a Python expression over the forward's parameters and the namespace
    path: str  # the argument it reads ("k_caches[0]")
    what: str  # for the explanation: what the compiled code assumed
    kind: str = "structure"  # "structure", "value" (a specialized scalar), "object" (by identity)


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """Why a call does not match. kind: "state" (global state), "structure" (types, lengths, keys,
    tensor dtype/device/rank/strides), "value" (a scalar Dynamo specialized), "object" (another
    object than the one compiled for), "size" (a tensor size
    compiled as a constant), "relation" (symbolic sizes no longer related as compiled)."""

    kind: str
    subject: str  # what differs, without the values (one warning per subject)
    message: str
    progress: int = 0  # how many of the check's steps the call passed


# Builtins the generated code uses, under names a forward's parameters cannot shadow.
_BUILTINS = {"__te_type": type, "__te_len": len, "__te_list": list, "__te_int": int}


class CallSignature:
    def __init__(self, func: Callable, self_arg: Any, args: tuple, kwargs: dict,
                 graph_inputs: dict[str, Any] | None):
        self.name = func.__qualname__
        self._graph_inputs = graph_inputs if graph_inputs is not None else {}  # none: all as at this call
        self._ns: dict[str, Any] = dict(_BUILTINS)
        self._conditions: list[_Condition] = []
        self._tensors: list[tuple[str, torch.Tensor]] = []  # (path, tensor)
        self._tensor_args: list[str] = []  # how the check passes them: paths, or *path for a list of tensors
        self._tensor_sizes: list[list[int | None]] = []
        self._tensor_strides: list[list[int | None]] = []
        self._symbolic: list[tuple[str, Any, int]] = []  # (path expression, sympy expr, value at this call)
        self._seen: dict[int, str] = {}  # id(tensor) -> path of its first occurrence

        sig = inspect.signature(func)
        params = list(sig.parameters.values())
        if self_arg is not None:
            params = params[1:]
        bound = inspect.Signature(params).bind(*args, **kwargs)
        bound.apply_defaults()
        self._params = params
        for name, value in bound.arguments.items():
            self._walk(name, f"L[{name!r}]", value)
        relations = self._relations()
        self._tensor_guards = compat.tensor_guards([t for _, t in self._tensors], self._tensor_sizes,
                                                   self._tensor_strides)
        self._ns["__te_global_state"] = compat.global_state_guard().check
        self.check = self._generate(relations)
        self._relation_conditions = relations

    # -- what the compiled call looked like --------------------------------------------------------

    def _const(self, value: Any) -> str:
        name = f"__te_c{len(self._ns)}"
        self._ns[name] = value
        return name

    def _walk(self, path: str, source: str, value: Any) -> None:
        typ = type(value)
        if isinstance(value, torch.Tensor):
            self._tensor(path, source, value)
        elif isinstance(value, (list, tuple)):  # torch.Size and namedtuples too
            self._conditions.append(_Condition(f"__te_type({path}) is {self._const(typ)} and __te_len({path}) == "
                                               f"{len(value)}", path, f"a {typ.__name__} of length {len(value)}"))
            start = len(self._tensor_args)
            for i, item in enumerate(value):
                self._walk(f"{path}[{i}]", f"{source}[{i}]", item)
            if value and len(self._tensor_args) - start == len(value) and all(type(t) is torch.Tensor for t in value):
                self._tensor_args[start:] = [f"*{path}"]  # its length is checked: unpack it in C
        elif typ is dict and all(type(k) in (str, int) for k in value):
            keys = self._const(list(value))
            self._conditions.append(_Condition(f"__te_type({path}) is {self._const(dict)} and __te_list({path}) == "
                                               f"{keys}", path, f"a dict with keys {list(value)}"))
            for k, item in value.items():
                self._walk(f"{path}[{k!r}]", f"{source}[{k!r}]", item)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            self._conditions.append(_Condition(f"__te_type({path}) is {self._const(typ)}", path, f"a {typ.__qualname__}"))
            for field in dataclasses.fields(value):
                if field.name.isidentifier():
                    self._walk(f"{path}.{field.name}", f"{source}.{field.name}", getattr(value, field.name))
        elif typ is int and isinstance(self._graph_inputs.get(source), torch.SymInt):
            self._conditions.append(_Condition(f"__te_type({path}) is __te_int", path, "an int"))
            expr = self._graph_inputs[source].node.expr
            if expr.is_number:
                self._conditions.append(_Condition(f"{path} == {int(expr)}", path, f"the int {int(expr)}", "value"))
            else:
                self._symbolic.append((path, expr, value))
        elif value is None or typ is bool:
            self._conditions.append(_Condition(f"{path} is {value!r}", path, f"{value!r}", "value"))
        elif isinstance(value, _CONSTANT_TYPES) and value == value:  # (not NaN)
            self._conditions.append(_Condition(f"__te_type({path}) is {self._const(typ)} and {path} == "
                                               f"{self._const(value)}", path, f"{value!r}", "value"))
        else:  # Dynamo may have specialized on anything it read from it
            try:  # held weakly: a variant must not keep the object alive (a KV cache on the GPU)
                check = f"{self._const(weakref.ref(value))}() is {path} is not None"
            except TypeError:  # cannot be weakly referenced
                check = f"{path} is {self._const(value)}"
            self._conditions.append(_Condition(check, path,
                                               f"another {typ.__qualname__} object (objects other than dataclasses "
                                               "are checked by identity)", "object"))

    def _tensor(self, path: str, source: str, value: torch.Tensor) -> None:
        first = self._seen.get(id(value))
        if first is not None:  # Dynamo passed one graph input for both
            self._conditions.append(_Condition(f"{path} is {first}", path, f"the same tensor as {first}"))
            return
        self._seen[id(value)] = path
        if type(value) is not torch.Tensor:
            self._conditions.append(_Condition(f"__te_type({path}) is {self._const(type(value))}", path,
                                               f"a {type(value).__qualname__}"))
        fake = self._graph_inputs.get(source)
        fake = fake if isinstance(fake, torch.Tensor) and fake.dim() == value.dim() else None
        sizes, strides = [], []
        for kind, real, compiled, out in (("shape", value.shape, fake.shape if fake is not None else None, sizes),
                                          ("stride", value.stride(), fake.stride() if fake is not None else None,
                                           strides)):
            for d, n in enumerate(real):
                expr = compiled[d].node.expr if compiled is not None and isinstance(compiled[d], torch.SymInt) else None
                if expr is None or expr.is_number:
                    out.append(int(expr) if expr is not None else int(n))
                else:
                    out.append(None)
                    access = f"{path}.shape[{d}]" if kind == "shape" else f"{path}.stride({d})"
                    self._symbolic.append((access, expr, int(n)))
        self._tensors.append((path, value))
        self._tensor_args.append(path)
        self._tensor_sizes.append(sizes)
        self._tensor_strides.append(strides)

    def _relations(self) -> list[_Condition]:
        """Symbolic sizes and ints: the first plain-symbol occurrence binds it; the others must equal
        what the compiled code computes them as. One that cannot be written that way stays constant."""
        bound: dict[Any, str] = {}
        out: list[_Condition] = []
        sizes_first = sorted(self._symbolic, key=lambda s: ".stride(" in s[0])
        for access, expr, value in sizes_first:
            if expr.is_Symbol and expr not in bound:
                bound[expr] = access
                continue
            code = _python(expr, bound)
            if code is None:  # the compiled code's reasoning about it is not ours to redo: keep it as it was
                out.append(_Condition(f"{access} == {value}", access, f"{value} (Dynamo compiled it as {expr})",
                                      "relation"))
            else:
                out.append(_Condition(f"{access} == {code}", access, f"{code} (Dynamo compiled it as {expr})",
                                      "relation"))
        return out

    # -- the generated check ---------------------------------------------------------------------

    def _parameter_list(self) -> str:
        parts, star_done = [], False
        for p in self._params:
            if p.kind is p.VAR_POSITIONAL:
                parts.append(f"*{p.name}")
                star_done = True
            elif p.kind is p.VAR_KEYWORD:
                parts.append(f"**{p.name}")
            else:
                if p.kind is p.KEYWORD_ONLY and not star_done:
                    parts.append("*")
                    star_done = True
                parts.append(p.name)
                if p.kind is p.POSITIONAL_ONLY and not any(q.kind is q.POSITIONAL_ONLY
                                                           for q in self._params[self._params.index(p) + 1:]):
                    parts.append("/")
        return ", ".join(parts)

    def _generate(self, relations: list[_Condition]) -> Callable[..., bool]:
        tensors = ", ".join(self._tensor_args)
        self._ns["__te_tensors"] = self._tensor_guards.check
        checks = ["__te_global_state()"] + [c.code for c in self._conditions]
        lines = [f"def {self.name.rpartition('.')[2]}({self._parameter_list()}):",
                 f"    if not ({' and '.join(f'({c})' for c in checks)}):",
                 "        return False"]
        if self._tensors:
            lines += [f"    if not __te_tensors({tensors}):",
                      "        return False"]
        lines.append(f"    return {' and '.join(f'({c.code})' for c in relations) if relations else 'True'}")
        self.source = "\n".join(lines)
        namespace = dict(self._ns)
        exec(compile(self.source, f"<torch_ext call signature of {self.name}>", "exec"), namespace)
        fn = namespace[self.name.rpartition(".")[2]]
        positional = [p for p in self._params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        defaults = [p.default for p in positional if p.default is not p.empty]  # a suffix of them
        fn.__defaults__ = tuple(defaults) or None
        fn.__kwdefaults__ = {p.name: p.default for p in self._params
                             if p.kind is p.KEYWORD_ONLY and p.default is not p.empty} or None
        return fn

    # -- why a call does not match ----------------------------------------------------------------

    def explain(self, args: tuple, kwargs: dict) -> Mismatch | None:
        """The first assumption of the compiled code that the call breaks; None if it matches."""
        try:
            bound = inspect.Signature(self._params).bind(*args, **kwargs)
        except TypeError as e:
            return Mismatch("structure", "arguments", str(e))
        bound.apply_defaults()
        scope = dict(self._ns, **bound.arguments)
        if not scope["__te_global_state"]():
            reason = compat.global_state_reason(self._ns["__te_global_state"]).strip()
            return Mismatch("state", "global state", f"the global state Dynamo guards ({reason}) differs from "
                                                     "the compiled call's")
        for step, c in enumerate(self._conditions, 1):
            if not eval(c.code, scope):
                return Mismatch(c.kind, c.path, f"argument {c.path} is {_short(eval(c.path, scope))}; the code "
                                                f"was compiled for {c.what}", step)
        step = len(self._conditions) + 1
        tensors = [eval(path, scope) for path, _ in self._tensors]
        verbose = compat.tensor_guards_reason(self._tensor_guards, tensors, [p for p, _ in self._tensors])
        if verbose is not None:  # "tensor 'x' size mismatch at index 0. expected 1, actual 8", or aliasing
            match = re.match(r"tensor '(.*?)' (.*)", verbose)
            if match is None:
                return Mismatch("structure", verbose, f"the call's tensors do not match the compiled code: {verbose}",
                                step)
            name, what = match.groups()
            return Mismatch("size" if what.startswith("size mismatch") else "structure",
                            f"{name} {what.split('. expected')[0]}",
                            f"argument {name} does not match the compiled code: {what}", step)
        for step, c in enumerate(self._relation_conditions, step + 1):
            if not eval(c.code, scope):
                return Mismatch("relation", c.path, f"{c.path} is {eval(c.path, scope)}; the code was compiled "
                                                    f"for it to be {c.what}", step)
        return None


def _python(expr, bound: dict) -> str | None:
    """expr (sums, products and integer powers of bound symbols and integers) as Python, else None."""
    if expr.is_Integer:
        return str(int(expr))
    if expr.is_Symbol:
        return bound.get(expr)
    if isinstance(expr, (sympy.Add, sympy.Mul)):
        parts = [_python(a, bound) for a in expr.args]
        if None in parts:
            return None
        return "(" + (" + " if isinstance(expr, sympy.Add) else " * ").join(parts) + ")"
    if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and int(expr.exp) >= 0:
        base = _python(expr.base, bound)
        return None if base is None else f"({base} ** {int(expr.exp)})"
    return None


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} ({value.dtype}, {value.device})"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of length {len(value)}"
    if isinstance(value, _CONSTANT_TYPES):
        return repr(value)
    return f"a {type(value).__qualname__}"
