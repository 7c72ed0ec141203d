"""Stage 3, runtime: what the split graph calls on every step.

Owns: per-piece runners that pick a compiled variant by the runtime size (`piecewise.py`,
`piece_group.py`), piece inputs in their compiled layout (`layout.py`), calling custom-op
splitting ops without their Python layers (`direct_call.py`), and CUDA graphs (`cudagraph/`:
manager, per-region runner, padding, statistics, errors, module-state store checks), and the buffers
of merged projections, checked against the parameters every call (`merged_params.py`); graph calls
one at a time in the process (`serial_calls.py`); gradients a CUDA-graphed backward left in the
trees' pool, moved out where they would be overwritten (`pool_gradients.py`).
May import: compile, split, rewrite, config / counters / dump; never warm_start or dispatch.
"""
