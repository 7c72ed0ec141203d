"""Stage 2, compile: one piece graph and a variant (general, size range, size) -> a callable.

Owns: Inductor compiles (`compiler.py`, with the post-grad passes of backend/passes), loading or
compiling each distinct artifact once (`builder.py`), the on-disk cache and its key (`cache.py`,
`environment.py`, `fingerprint.py`, `inductor_keys.py`), example values restored before a
compile (`example_values.py`), and the Inductor options (dependent launch, combo kernels) for
pieces that run torch_ext's decode kernels (`decode_options.py`).
May import: split, passes, config / counters / dump; never runtime, warm_start or dispatch.
"""
