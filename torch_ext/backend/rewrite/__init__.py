"""Stage 0, rewrite: changes to the Dynamo graph itself, before it is split.

Owns: merging projections that read the same input into one GEMM for inference graphs
(`merge_projections.py`: the graph rewrite and the plan it returns; the buffers that hold the merged
weights at run time are runtime/merged_params.py's).
May import: torch_ext.backend.config / counters / dump only (and torch_ext.compat).
"""
