"""Guard-free dispatch and `torch_ext.compile`, standing on top of the backend and warm start.

Owns: calling Dynamo's transformed code directly after one generated check of the call
(`dispatcher.py`, `signature.py`), and the `compile` entry point (`entry.py`).
May import: every other stage of the backend; nothing imports it but `torch_ext.compile`.
"""
from torch_ext.backend.dispatch.dispatcher import GuardFreeDispatcher, GuardFreeDispatchWarning
from torch_ext.backend.dispatch.entry import compile

__all__ = ["GuardFreeDispatchWarning", "GuardFreeDispatcher", "compile"]
