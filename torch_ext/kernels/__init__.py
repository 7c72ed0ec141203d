"""torch_ext's hand-written kernels and the custom ops that launch them (torch_ext.kernels).

Owns: `torch_ext::decode_attention` (split-KV Triton kernels), `torch_ext::decode_linear` (a Triton GEMV
and an NVRTC-compiled CUDA kernel for 2-32 rows, launched with PDL by `cuda_launch.py`),
`torch_ext::fused_add_rms_norm`, the PDL helpers their kernels share (`pdl_kernels.py`), and the
per-thread switch that has the decode ops run their reference (`launch_policy.py`).
May import: torch_ext.compat only; never torch_ext.backend (the backend's rewrites call these ops).
The op namespaces (`torch_ext::...`) are what saved graphs and warm-start caches name: keep them.
"""
