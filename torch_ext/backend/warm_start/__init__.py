"""Warm start: a new process runs the program an earlier one saved, without tracing.

Owns: the saved programs, found, loaded or traced at the first call (`program.py`), what
`torch_ext.compile` returns with them and what a compiled forward pickles as (`module.py`), the Dynamo graph saved with
the example values the backend reads (`saved_graph.py`), and what keys a saved program (`key.py`:
model, call signature, torch_ext's own sources).
May import: the backend (backend.py) and every stage below it; never dispatch.
"""
