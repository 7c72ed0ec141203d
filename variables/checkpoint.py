"""Activation checkpoint (`torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False)`), traced
as the `tag_activation_checkpoint` HOP. AOTAutograd inlines its body, so aliasing is fine."""
from __future__ import annotations

from torch._dynamo.utils import proxy_args_kwargs

from torch_ext import compat, config

from .base import WrapSemanticsMixin
from .reproxify import call_and_reproxify


class CheckpointVariable(WrapSemanticsMixin, compat.CheckpointHigherOrderVariable):
    def body_options(self, tx):
        opts = super().body_options(tx)
        allow = config.checkpoint_side_effects or compat.torch_allows_checkpoint_side_effects()
        return type(opts)(**{**opts.__dict__, "checkpoint": True, "allow_side_effects": allow})

    def call_with_wrap_semantics(self, tx, args, kwargs):
        from torch._higher_order_ops.wrap import TagActivationCheckpoint
        from torch.utils.checkpoint import noop_context_fn

        kwargs = dict(kwargs)
        context_fn = None
        ctx_vt = kwargs.get("context_fn")
        if ctx_vt is not None and not (ctx_vt.is_python_constant() and ctx_vt.as_python_constant() is noop_context_fn):
            kwargs.pop("context_fn")
            try:
                context_fn = compat.python_constant_with_guards(ctx_vt)
            except NotImplementedError:
                compat.unimplemented(
                    gb_type="torch_ext: unsupported checkpoint context_fn",
                    context=str(ctx_vt),
                    explanation="checkpoint's context_fn must be a function or functools.partial.",
                    hints=["Pass a plain function (or functools.partial of one) as context_fn."],
                )
        # Checkpoint options (use_reentrant, preserve_rng_state, ...) go on the call; the rest are
        # arguments of the body.
        checkpoint_kwargs, body_kwargs = TagActivationCheckpoint.divide_kwargs(kwargs)
        spec, body_gmod, _, proxy_args = self.trace_body(
            tx, args[0], args[1:], body_kwargs, subgraph_name="wrap_body"
        )
        if context_fn is not None:
            body_gmod.meta["_checkpoint_context_fn"] = context_fn
        _, checkpoint_kwargs = proxy_args_kwargs([], checkpoint_kwargs)
        return call_and_reproxify(tx, self.value, proxy_args, checkpoint_kwargs, spec)
