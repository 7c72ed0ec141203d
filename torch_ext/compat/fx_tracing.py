"""torch.fx's tracer patches process-wide names while it traces, for every thread.

`Tracer.trace` (symbolic_trace, make_fx, so AOTAutograd) replaces `torch.nn.Module.__call__`,
`Module.__getattr__` and functions in the traced code's module globals through `_Patcher`, in the
class and module dicts, until the trace ends. Another thread that runs a model meanwhile goes through
the tracer's wrappers: under symbolic_trace its module calls raise "module is not installed as a
submodule" (seen: an eager call of a background-compiling process, while Inductor's first loop body
traced its dummy graph); under make_fx they run through the tracer's Python. With background compile
the compile thread traces while serving threads run the model eagerly, so we keep each patch to the
thread that made it: other threads call what was there before. `_Patcher.patch`/`patch_method` have the
same signature on 2.9.1 through 2.15.
"""
from __future__ import annotations

import builtins
import functools
import threading

from torch.fx import _symbolic_trace

_original_patch = _symbolic_trace._Patcher.patch
_original_patch_method = _symbolic_trace._Patcher.patch_method


def _for_this_thread(new_fn, before):
    """new_fn on the thread that patches, `before` on every other one."""
    owner = threading.get_ident()

    @functools.wraps(new_fn)
    def per_thread(*args, **kwargs):
        if threading.get_ident() == owner:
            return new_fn(*args, **kwargs)
        return before(*args, **kwargs)

    return per_thread


def _patch(self, frame_dict, name, new_fn, deduplicate=True):
    before = frame_dict[name] if name in frame_dict else getattr(builtins, name, None)
    if before is None or not callable(before):
        return _original_patch(self, frame_dict, name, new_fn, deduplicate)
    return _original_patch(self, frame_dict, name, _for_this_thread(new_fn, before), deduplicate)


def _patch_method(self, cls, name, new_fn, deduplicate=True):
    before = getattr(cls, name)
    return _original_patch_method(self, cls, name, _for_this_thread(new_fn, before), deduplicate)


def confine_fx_patches_to_their_thread() -> None:
    """From now on an fx trace's patches act on its own thread only (idempotent)."""
    _symbolic_trace._Patcher.patch = _patch
    _symbolic_trace._Patcher.patch_method = _patch_method


def fx_patches_confined() -> bool:
    return _symbolic_trace._Patcher.patch is _patch


def restore_fx_patches() -> None:
    """torch's own behaviour again (tests show it side by side)."""
    _symbolic_trace._Patcher.patch = _original_patch
    _symbolic_trace._Patcher.patch_method = _original_patch_method
