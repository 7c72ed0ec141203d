"""Stage 0, rewrite: changes to the Dynamo graph itself, before it is split.

Owns: merging projections that read the same input into one GEMM for inference graphs
(`merge_projections.py`: the graph rewrite and the plan it returns; the buffers that hold the merged
weights at run time are runtime/merged_params.py's); a decode step's SDPA calls replaced by
torch_ext::decode_attention (`decode_attention.py`; the op is kernels/decode_attention.py); linear calls
of a few rows by torch_ext::decode_linear (`decode_linear.py`), which then also take the RMSNorm and
gate before them and the residual add after them (`decode_linear_fusion.py`).
May import: torch_ext.backend.config / counters / dump only (and torch_ext.compat, torch_ext.kernels).
"""
