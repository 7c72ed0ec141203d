"""The errors of torch_ext's CUDA graphs, apart from the code that raises them so that the
dispatcher can catch them without importing the CUDA-graph machinery."""
from __future__ import annotations

import torch.fx as fx


class CudaGraphError(RuntimeError):
    """Base of the CUDA-graph errors torch_ext raises."""


class CudaGraphAddressError(CudaGraphError):
    """An input read in place by a captured graph is no longer where it was at capture."""


class CudaGraphCaptureError(CudaGraphError):
    """The region could not be captured (it synchronizes with the host, or uses the CPU)."""


class CudaGraphBufferMutationError(CudaGraphError):
    """A forward assigns or mutates module state that captured graphs read in place."""


def mutation_error(placeholder: fx.Node, writer: fx.Node) -> CudaGraphBufferMutationError:
    trace = (writer.meta.get("stack_trace") or "").rstrip() or "  (no source location recorded)"
    kind = "parameter" if "parameters_" in placeholder.name.lower() else "buffer"
    return CudaGraphBufferMutationError(
        f"torch_ext: with CUDA graphs on, the forward mutates the module {kind} '{placeholder.name}' in place "
        f"outside a splitting op:\n    {writer.format_node()}\nat:\n{trace}\n"
        f"Captured graphs run at padded batch sizes, so an in-place update of module state inside them is "
        f"silently wrong (it sees the padding rows). Do the update in a splitting op (it runs eagerly, at the "
        f"real batch size), pass the tensor as an argument, or use cudagraph_mode='none'.")
