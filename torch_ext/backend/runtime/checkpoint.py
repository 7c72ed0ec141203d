"""Activation-checkpoint regions the split cuts: recomputed in backward, as the user asked.

A `checkpoint(..., use_reentrant=False)` region (Dynamo's `tag_activation_checkpoint` HOP) that
holds a splitting op cannot stay one HOP inside one compiled piece: its body is split like any
graph, into compiled pieces and eager splitting ops. Run as plain pieces, each would save its own
activations for backward (2-3x what Inductor saves for the same model). `CheckpointedRegion` runs
the split body under one non-reentrant `torch.utils.checkpoint` instead: forward keeps only the
region's inputs, backward runs the compiled pieces and splitting ops again (with the forward's RNG
state) and differentiates that, exactly what eager checkpointing does. Measured against the other
way (recompute tags honoured by each piece's partitioner, which must still save every tensor a
splitting op saves for itself): see bench/checkpoint_memory.py.

Selective checkpointing (`context_fn`) is not run this way around compiled pieces: its policy
would see the out= ops Inductor's code calls (and could hand back a cached tensor where the code
expected its out= buffer written). Its compiled pieces carry the policy inside instead
(split/checkpoint.py), and `CheckpointedRegion` with the policy runs each eager splitting op of
the region, whose ATen ops the policy sees as in eager.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint

# torch.utils.checkpoint's own options, as Dynamo records them on the HOP call; the rest are the body's.
_CHECKPOINT_OPTIONS = ("preserve_rng_state", "determinism_check", "debug")


class CheckpointedRegion(torch.nn.Module):
    """Calls a split checkpoint body (or, with a context_fn, an eager splitting op of a selective
    region) under non-reentrant torch.utils.checkpoint when autograd records."""

    def __init__(self, body: fx.GraphModule, hop_kwargs: dict[str, Any], label: str, context_fn=None):
        super().__init__()
        self.body = body
        self.options = {k: v for k, v in hop_kwargs.items() if k in _CHECKPOINT_OPTIONS}
        if context_fn is not None:
            self.options["context_fn"] = context_fn
        self.label = label  # where the region is in the model's source, for messages

    def forward(self, *args):
        # The body's code, not its nn.Module call: hooks are not the body's business, and a
        # GraphModule's call formats a traceback for every exception passing through it.
        if not torch.is_grad_enabled():  # nothing is saved without autograd: no recompute to arrange
            return self.body.forward(*args)
        # early_stop=False: recompute the whole region (as Inductor does) instead of stopping it
        # with an exception once the tensors backward needs are back (that exception costs more
        # host time, through every GraphModule call it leaves, than the region's last ops).
        return torch.utils.checkpoint.checkpoint(self.body.forward, *args, use_reentrant=False, early_stop=False,
                                                 **self.options)

    def extra_repr(self) -> str:
        return f"{self.label}, {self.options}" if self.options else self.label
