"""torch.compile(backend="torch_ext", mode=..., options=...): the CompileConfig a mode and options name."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from torch_ext.backend.config import CompileConfig, ConfigError


# torch.compile(mode=...) read for backend="torch_ext" (transformers' generate passes its
# CompileConfig's mode, "reduce-overhead" by default): the nearest CompileConfig.
TORCH_COMPILE_MODES: dict[str | None, dict[str, Any]] = {
    None: {},
    "default": {},
    "reduce-overhead": {"cudagraph_mode": "full"},
    "max-autotune-no-cudagraphs": {"inductor_options": {"max_autotune": True}},
    "max-autotune": {"cudagraph_mode": "full", "inductor_options": {"max_autotune": True}},
}


def from_torch_compile(mode: str | None, options: Mapping[str, Any] | None) -> CompileConfig:
    """The CompileConfig for `torch.compile(..., backend="torch_ext", mode=mode, options=options)`:
    the mode as above; options are CompileConfig fields (they win over the mode's)."""
    if mode not in TORCH_COMPILE_MODES:
        raise ConfigError(f"torch.compile(backend='torch_ext', mode={mode!r}): not a torch.compile mode. Use one "
                          f"of {[m for m in TORCH_COMPILE_MODES if m]}, or pass "
                          "backend=torch_ext.backend(CompileConfig(...))")
    fields = {f.name for f in dataclasses.fields(CompileConfig)}
    unknown = sorted(set(options or {}) - fields)
    if unknown:
        raise ConfigError(f"torch.compile(backend='torch_ext', options=...): {unknown} are not CompileConfig "
                          f"fields (options name CompileConfig fields: {sorted(fields)}). Inductor settings go "
                          "in options={'inductor_options': {...}}")
    return CompileConfig(**{**TORCH_COMPILE_MODES[mode], **(options or {})})
