"""`torch.distributed.tensor.experimental.local_map` traced as one `local_map_hop` call, with wrap semantics.

`local_map(func, ...)` returns `functools.partial(_local_map_wrapped, func, out_placements,
in_placements, in_grad_placements, device_mesh, redistribute_inputs)`. When Dynamo meets
`_local_map_wrapped` (install() maps it to `LocalMapVariable` in VariableBuilder's id table), the call
is traced as:

    torch's own `_local_map_wrapped`, inlined      DTensor checks, redistribute, to_local(grad_placements)
      -> func(*local_args, **kwargs)               one local_map_hop(subgraph, *local tensors) call
    torch's own `_local_map_wrapped`, continued    DTensor.from_local per out_placements

so the DTensor <-> local conversion is torch's exact eager code on every version, and the HOP body only
ever sees plain local tensors. The body is speculated with wrap semantics: it may return any Python
structure (dataclasses, user objects holding tensors); only the tensors and SymInts it computed become
HOP outputs. Outputs that are not tensor leaves of the flattened output need `None` placements, as in
eager.

torch 2.10+'s own local_map tracing (`LocalMapWrappedHigherOrderVariable.enable()`, for Autoparallel:
plain tensors standing for global ones, bodies traced with local shapes) is left exactly as torch does
it: while it is enabled, this VT defers to torch's.
"""
from __future__ import annotations

import torch

from torch_ext import compat

from .base import WrapSemanticsMixin
from .reproxify import call_and_reproxify

HOP_NAME = "local_map_hop"
_LOCAL_MAP_ARGS = ("func", "out_placements", "in_placements", "in_grad_placements", "device_mesh",
                   "redistribute_inputs")


def _hop():
    from torch_ext.hops.local_map import local_map_hop

    return local_map_hop


def _constant(vt):
    """The Python value of a local_map option (placements, mesh, flags); None where not constant."""
    try:
        return vt.as_python_constant()
    except NotImplementedError:
        return None


def _fail(what: str, context: str, hint: str):
    compat.unimplemented(
        gb_type=f"torch_ext: unsupported {HOP_NAME} body",
        context=context,
        explanation=f"{HOP_NAME} (torch.distributed.tensor.experimental.local_map): {what}",
        hints=[hint],
    )


def _is_subclass_tensor(value) -> bool:
    """A tensor subclass such as DTensor (example values of plain tensors are FakeTensors)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return isinstance(value, torch.Tensor) and is_traceable_wrapper_subclass(value)


class LocalMapVariable(WrapSemanticsMixin, compat.LocalMapHigherOrderVariableBase):
    """Called as `_local_map_wrapped(func, out_placements, in_placements, in_grad_placements,
    device_mesh, redistribute_inputs, *args, **kwargs)` (torch 2.10+'s convention for this VT)."""

    body_supports_input_mutation = False
    try_torch_first = False  # torch traces local_map only for Autoparallel (below)
    body_supports_aliasing = False

    def call_with_wrap_semantics(self, tx, args, kwargs):
        if compat.torch_local_map_autoparallel_enabled():
            return super(WrapSemanticsMixin, self)._call_function(tx, args, kwargs)  # torch's own Autoparallel tracing
        # A direct `local_map_hop(body_gm, *operands)` call passes a GraphModule, not local_map's
        # six leading arguments.
        if len(args) < len(_LOCAL_MAP_ARGS) or isinstance(getattr(args[0], "value", None), torch.fx.GraphModule):
            _fail(
                "it is called directly; under torch.compile it is reached through local_map.",
                f"{len(args)} positional arguments",
                "Call the function returned by torch.distributed.tensor.experimental.local_map(...).",
            )
        from torch.distributed.tensor.experimental._func_map import _local_map_wrapped

        options = {name: _constant(vt) for name, vt in zip(_LOCAL_MAP_ARGS[1:], args[1:])}
        body = LocalMapBodyVariable(self, args[0], options)
        # torch's own wrapper, inlined, with the user's body replaced by one that traces the HOP.
        return compat.user_function_variable(_local_map_wrapped).call_function(
            tx, [body, *args[1:]], dict(kwargs)
        )

    def trace_local_body(self, tx, fn_vt, args, kwargs, options: dict):
        """Trace `fn_vt(*args, **kwargs)` (local tensors) into one local_map_hop call."""
        spec, body_gmod, _, proxy_args = self.trace_body(
            tx, _LocalBodyFunction(fn_vt), args, kwargs, subgraph_name="subgraph"
        )
        # torch's key (torch 2.10+'s implementations read it). The HOP's operands are local tensors:
        # gradient placements were applied by to_local() outside it, so the HOP itself has none.
        body_gmod.meta["local_map_kwargs"] = {**options, "in_grad_placements": None}
        return call_and_reproxify(tx, self.value, proxy_args, {}, spec)


class _LocalBodyFunction(compat.VariableTracker):
    """Runs the user's body inside the HOP's subtracer, then refuses tensor subclasses (DTensor) at
    its boundary before anything else inspects the subgraph: the body runs on local tensors only."""

    def __init__(self, fn_vt, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fn_vt = fn_vt

    def python_type(self):
        return self.fn_vt.python_type()

    def call_function(self, tx, args, kwargs):
        from .collect import walk

        output = self.fn_vt.call_function(tx, args, kwargs)
        tracer = tx.output.current_tracer
        for outer in tracer.lifted_freevars:
            value = outer.node.meta.get("example_value")
            if _is_subclass_tensor(value):
                _fail(
                    f"the body uses a {type(value).__name__} that is not one of its arguments "
                    f"(`{outer.node.name}`, closed over or a module attribute); the body runs on local "
                    "tensors only.",
                    f"{type(value).__name__} {outer.node.name}",
                    "Pass it to the local_map function as an argument with its placements in "
                    "in_placements (or call .to_local() before the local_map call and use that).",
                )
        for found in walk(tx, output):
            proxy = getattr(found.vt, "proxy", None)
            value = proxy.node.meta.get("example_value") if isinstance(proxy, torch.fx.Proxy) else None
            if _is_subclass_tensor(value):
                _fail(
                    f"the body returns a {type(value).__name__} at `{found.path}`; it must return "
                    "local tensors.",
                    f"{found.path}: {type(value).__name__}",
                    "Return the local tensor; local_map wraps tensor outputs into DTensors per "
                    "out_placements.",
                )
        return output


class LocalMapBodyVariable(compat.VariableTracker):
    """The user's local_map body while Dynamo inlines `_local_map_wrapped`: calling it traces the body
    as one local_map_hop call."""

    _nonvar_fields = {"options", *compat.VariableTracker._nonvar_fields}

    def __init__(self, hop_vt: LocalMapVariable, fn_vt, options: dict, **kwargs) -> None:
        super().__init__(**kwargs)
        self.hop_vt = hop_vt
        self.fn_vt = fn_vt
        self.options = options

    def python_type(self):
        return self.fn_vt.python_type()

    def call_function(self, tx, args, kwargs):
        return self.hop_vt.trace_local_body(tx, self.fn_vt, list(args), dict(kwargs), self.options)


def _build_local_map_variable(builder, value):
    """VariableBuilder handler for `_local_map_wrapped` (registered by install())."""
    from torch._dynamo.guards import GuardBuilder

    builder.install_guards(GuardBuilder.ID_MATCH)
    return LocalMapVariable(_hop(), builder.source)


def builder_id_dispatch_entries() -> dict:
    """{python object: VariableBuilder handler} that install() adds to Dynamo's id table."""
    if not torch.distributed.is_available():
        return {}
    from torch.distributed.tensor.experimental._func_map import _local_map_wrapped

    return {_local_map_wrapped: _build_local_map_variable}
