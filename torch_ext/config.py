"""torch_ext's own switches, read at trace time (module attributes, as torch._dynamo.config)."""
from __future__ import annotations

import contextlib
import sys

# Let activation-checkpoint bodies mutate outer Python state (`outer_list.append(t)`, attribute
# stores). Tensors the body stores that way become extra subgraph outputs. Divergence from eager:
# eager checkpoint re-runs the body's Python during backward (so the side effect happens twice);
# compiled code runs it once. Off by default, as in torch.
checkpoint_side_effects: bool = False


@contextlib.contextmanager
def patch(**changes):
    """`with torch_ext.config.patch(checkpoint_side_effects=True): ...`"""
    module = sys.modules[__name__]
    unknown = [name for name in changes if not hasattr(module, name) or name == "patch"]
    if unknown:
        raise AttributeError(f"torch_ext.config has no option(s) {unknown}")
    saved = {name: getattr(module, name) for name in changes}
    for name, value in changes.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
