"""What guard-free dispatch checks of the module itself, besides the call's arguments.

Dynamo freezes module state into the code it compiles and guards it; guard-free dispatch skips those
guards. Two kinds of state change too often to leave to the caller's promise, and are cheap to check
at the root module on every call:
* the training flag, which the standard `train()` / `eval()` set on the whole module tree;
* the root module's own plain attributes (ints, floats, bools, strings, None: `self.scale = 2.0`).
A call whose module state differs from the one a variant was compiled with does not run that variant:
it goes through torch.compile's guards (dispatcher.py). Deeper state (submodules' attributes,
globals) stays the caller's promise (docs/guide/cuda-graphs.md).
"""
from __future__ import annotations

from typing import Any

_PLAIN = (bool, int, float, str, type(None))
_MISSING = object()


class ModuleState:
    """The root module's training flag and plain attributes when a variant was armed."""

    def __init__(self, module: Any):
        self.module = module
        self.training = getattr(module, "training", None)
        attrs = vars(module) if module is not None and hasattr(module, "__dict__") else {}
        self.names = tuple(k for k, v in attrs.items() if isinstance(v, _PLAIN) and k != "training")
        self.values = tuple(attrs[k] for k in self.names)

    def matches(self) -> bool:
        module = self.module
        if module is None:
            return True
        if module.training is not self.training:
            return False
        attrs = module.__dict__
        return tuple([attrs.get(k, _MISSING) for k in self.names]) == self.values

    def changed(self) -> tuple[str, ...]:
        """The names of what changed: "training" and/or attribute names."""
        if self.module is None:
            return ()
        attrs = self.module.__dict__
        flag = ("training",) if self.module.training is not self.training else ()
        return flag + tuple(k for k, v in zip(self.names, self.values) if attrs.get(k, _MISSING) != v)

    def difference(self) -> str:
        """What changed, for messages."""
        if self.module is None:
            return "nothing"
        attrs = self.module.__dict__
        changed = [f"the training flag is {self.module.training} (compiled with {self.training})"
                   for _ in range(self.module.training is not self.training)]
        changed += [f"module attribute {k} = {attrs.get(k, '<deleted>')!r} (compiled with {v!r})"
                    for k, v in zip(self.names, self.values) if attrs.get(k, _MISSING) != v]
        return ", ".join(changed)
