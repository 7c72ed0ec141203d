"""`wrap`, `dynamo_bypassing_wrapper` and BaseHOP-derived HOPs: bodies that simply run at call time."""
from __future__ import annotations

from torch_ext import compat

from .base import WrapSemanticsMixin
from .reproxify import call_and_reproxify


class WrapVariable(WrapSemanticsMixin, compat.WrapHigherOrderVariable):
    """torch._higher_order_ops.wrap.wrap(fn, *args, **kwargs)."""

    def call_with_wrap_semantics(self, tx, args, kwargs):
        spec, _, _, proxy_args = self.trace_body(tx, args[0], args[1:], kwargs, subgraph_name="wrap_body")
        return call_and_reproxify(tx, self.value, proxy_args, {}, spec)


class DynamoBypassingWrapperVariable(WrapSemanticsMixin, compat.DynamoBypassingWrapperHigherOrderVariable):
    """dynamo_bypassing_wrapper(wrapper_fn, fn, *args): the wrapper runs at call time, unseen by Dynamo."""

    # The wrapper itself is stored on the body module, so it need not be a global.
    WRAPPER_META_KEY = "_dynamo_bypassing_wrapper_fn"

    def call_with_wrap_semantics(self, tx, args, kwargs):
        wrapper_vt = args[0]
        if not hasattr(wrapper_vt, "guard_as_python_constant"):
            compat.unimplemented(
                gb_type="torch_ext: unsupported dynamo_bypassing_wrapper wrapper",
                context=str(wrapper_vt),
                explanation="The wrapper passed to dynamo_bypassing_wrapper must be a function or "
                "functools.partial.",
                hints=["Pass a plain function (or functools.partial of one) as the wrapper."],
            )
        wrapper = compat.python_constant_with_guards(wrapper_vt)
        spec, body_gmod, _, proxy_args = self.trace_body(
            tx, args[1], args[2:], kwargs, subgraph_name="wrap_body"
        )
        body_gmod.meta[self.WRAPPER_META_KEY] = wrapper
        return call_and_reproxify(tx, self.value, (self.WRAPPER_META_KEY, *proxy_args), {}, spec)


class BaseHOPVariable(WrapSemanticsMixin, compat.BaseHOPVariable):
    """Any `torch._higher_order_ops.BaseHOP` subclass without a VT of its own: hop(fn, *args, **kw),
    where the keyword arguments are the HOP's own options, passed to the call node unchanged."""

    body_supports_input_mutation = False
    body_supports_aliasing = False
    is_base_hop = True

    def body_options(self, tx):
        opts = super().body_options(tx)
        return type(opts)(**{**opts.__dict__, "hop_name": self.value._name})

    def call_with_wrap_semantics(self, tx, args, kwargs):
        spec, _, _, proxy_args = self.trace_body(tx, args[0], args[1:], {}, subgraph_name="subgraph")
        proxy_kwargs = {key: value.as_proxy() for key, value in kwargs.items()}
        return call_and_reproxify(tx, self.value, proxy_args, proxy_kwargs, spec)
