"""Post-grad passes: `Pass` (base), `PassManager` (Inductor's custom post pass), `MultiOutputMatch`
(hand replacement of multi-output pattern matches) and the fusions built on them.

Adding a pass: subclass `Pass`, implement `__call__(graph)`, override `is_applicable(compile_size)`
to gate it by size and `config()` for settings that change its behaviour, list helper modules it
relies on in `source_dependencies`, and add an instance to `CompileConfig.post_grad_passes`.
"""
from torch_ext.backend.passes.base import Pass
from torch_ext.backend.passes.fusion_add_rms_norm import FuseAddRMSNormPass
from torch_ext.backend.passes.manager import PassManager
from torch_ext.backend.passes.multi_output_match import MultiOutputMatch
from torch_ext.backend.passes.unfuse_output_addmm import UnfuseOutputAddmm

__all__ = ["Pass", "PassManager", "MultiOutputMatch", "FuseAddRMSNormPass", "UnfuseOutputAddmm"]
