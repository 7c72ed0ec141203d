"""Compile one piece with Inductor (torch._inductor.standalone_compile), and turn the result into
bytes and back. Knows nothing of caches, dedup or dispatch."""
from __future__ import annotations

import contextvars
import dataclasses
import logging
import os
import tempfile
import time
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from torch_ext import compat, workarounds
from torch_ext.backend.compile.decode_options import decode_launch_order, decode_piece_patches, keyed_post_pass
from torch_ext.backend.compile.example_values import restore_example_values
from torch_ext.backend.config import CompileConfig, inductor_option_key
from torch_ext.backend.counters import counters
from torch_ext.backend.rewrite.per_size import rewrite_for_size

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Variant:
    """Which shapes a compiled artifact serves: all ("general"), one size, or a size range [lo, hi)."""

    kind: str  # "general" | "size" | "range"
    size: int | None = None
    lo: int | None = None
    hi: int | None = None

    @property
    def label(self) -> str:
        if self.kind == "size":
            return f"size={self.size}"
        if self.kind == "range":
            return f"range=[{self.lo},{self.hi})"
        return "general"

    @property
    def compile_size(self) -> int | None:
        return self.size if self.kind == "size" else None


GENERAL = Variant("general")

_current_variant: contextvars.ContextVar[Variant | None] = contextvars.ContextVar("torch_ext_variant", default=None)


def current_compile_variant() -> Variant | None:
    """The variant being compiled right now; post-grad passes read it to act per size or range."""
    return _current_variant.get()


class PieceCompileError(RuntimeError):
    pass


_said_fallback: set[str] = set()


def say_fallback_once(name: str, e: Exception) -> None:
    """Torch's own backends fall back without a word; a torch_ext user hears why their graph runs eagerly."""
    what = f"{type(e).__name__}: {e}"
    if what not in _said_fallback:
        _said_fallback.add(what)
        log.warning("torch_ext: Inductor cannot compile piece %s (%s), so Dynamo runs this graph's frame eagerly, as "
                    "it does under backend='inductor' (a graph break; TORCH_LOGS=graph_breaks shows where). A "
                    "data-dependent value inside an op's backward (.item(), .tolist()) is the usual cause.", name, what)


def _fake_mode_of(values):
    for v in values:
        if isinstance(v, torch._subclasses.FakeTensor):
            return v.fake_mode
    return None


def _unkeyed_options(config: CompileConfig) -> list[str]:
    """inductor_options whose value is code without a uuid (a plain function as post_grad_custom_post_pass):
    the config's hash knows them only by repr, which cannot tell an edited function from this one."""
    return [k for k, v in config.inductor_options.items() if inductor_option_key(v) is None]


def _load_pass_manager():
    from torch_ext.backend.passes import PassManager  # owned by the passes engineer; imported on use

    return PassManager


class InductorCompiler:
    _said_unsaveable = False  # per process (serialize)

    def __init__(self, config: CompileConfig):
        self.config = config
        self._pass_managers: dict[int | None, Any] = {}
        self._said_uncacheable = False

    def pass_manager(self, variant: Variant):
        """The post-grad PassManager for this variant (ours, then the user's own post_grad_custom_post_pass
        from inductor_options: a pass or a list, on every torch), or None when no pass is configured."""
        user_pass = self.config.inductor_options.get("post_grad_custom_post_pass")
        if not self.config.post_grad_passes and not self.config.unfuse_output_addmm and user_pass is None:
            return None
        size = variant.compile_size
        if size not in self._pass_managers:
            try:
                pass_manager_cls = _load_pass_manager()
            except ImportError as e:
                raise PieceCompileError(
                    "CompileConfig.post_grad_passes needs torch_ext.backend.passes.PassManager, which "
                    f"cannot be imported ({e}). Install a torch_ext that has it, or drop post_grad_passes."
                ) from e
            passes = tuple(self.config.post_grad_passes)
            if self.config.unfuse_output_addmm:
                from torch_ext.backend.passes import UnfuseOutputAddmm

                passes = (UnfuseOutputAddmm(),) + passes
            # The user's own post-grad pass runs after ours: neither replaces the other.
            self._pass_managers[size] = pass_manager_cls(passes, compile_size=size, then=user_pass)
        return self._pass_managers[size]

    def patches(self, gm: fx.GraphModule, variant: Variant = GENERAL) -> dict:
        """The Inductor options gm compiles with: ours, the user's, the workarounds, the post-grad passes."""
        # Workarounds for torch bugs win over the user's options: correct results first.
        patches = {**decode_piece_patches(gm, self.config.inductor_options), **self.config.inductor_options,
                   **workarounds.inductor_patches(gm)}
        post_pass = keyed_post_pass(patches, self.pass_manager(variant))  # the user's own pass inside it
        if post_pass is not None:
            patches["post_grad_custom_post_pass"] = post_pass
        return patches

    def options_of(self, gm: fx.GraphModule, variant: Variant = GENERAL) -> dict[str, str]:
        """patches(gm) as text: a post-grad pass by its uuid (part of an artifact's name, and of describe())."""
        out = {}
        for key, value in sorted(self.patches(gm, variant).items()):
            out[key] = f"pass {value.uuid()}" if hasattr(value, "uuid") else repr(value)
        return out

    def key_factors(self, variant: Variant) -> str:
        """What, besides the piece graph and the config, decides the compiled code of this variant."""
        pm = self.pass_manager(variant)
        return f"{variant.label}|passes={pm.uuid() if pm is not None else ''}|grad={torch.is_grad_enabled()}"

    def disk_cacheable(self) -> bool:
        """Whether compiled pieces may go to the disk cache: not where an Inductor option is code without a
        uuid (a plain function as post_grad_custom_post_pass), since a later process could not tell an
        edited function from this one; Inductor's own cache bypasses such passes too. Said once."""
        unkeyed = _unkeyed_options(self.config)
        if unkeyed and not self._said_uncacheable:
            self._said_uncacheable = True
            log.warning("torch_ext: inductor_options %s hold code without a uuid(), so pieces compiled with them are "
                        "not written to the disk cache (cache_dir); make each a "
                        "torch._inductor.custom_graph_pass.CustomGraphPass with a uuid() to cache them, or a post-grad "
                        "pass a torch_ext Pass in CompileConfig.post_grad_passes", unkeyed)
        return not unkeyed

    def piece_graph(self, gm: fx.GraphModule, example_inputs: Sequence[Any], variant: Variant) -> fx.GraphModule:
        """The graph Inductor compiles for this variant: gm, or for a size variant a copy with the
        decode rewrites a dynamic graph could not take (its shapes are known now)."""
        restore_example_values(gm)  # a piece of a graph a warm start loaded
        return rewrite_for_size(gm, example_inputs, self.config) if variant.kind == "size" else gm

    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], variant: Variant, *, name: str = ""):
        """Compile gm for the variant; returns Inductor's CompiledArtifact (callable with *args)."""
        gm = self.piece_graph(gm, example_inputs, variant)
        patches = self.patches(gm, variant)
        options = {"config_patches": patches}
        start = time.perf_counter()
        token = _current_variant.set(variant)
        # Training pieces: what makes their artifact saveable on this torch (compat).
        functorch_patches = compat.saveable_training_patches() if torch.is_grad_enabled() else {}
        try:
            with torch._functorch.config.patch(functorch_patches), decode_launch_order(patches):
                artifact = self._standalone_compile(gm, example_inputs, variant, options)
        except torch._dynamo.exc.TorchDynamoException:
            raise  # Dynamo's own control flow (e.g. restart with specialized float scalars)
        except Exception as e:
            if variant.kind == "general" and isinstance(e, compat.backend_fallback_exceptions()):
                # As under torch.compile's own backends: Dynamo runs this frame eagerly (a graph break). Size
                # and range variants compile after Dynamo's call of the backend, where nobody falls back.
                say_fallback_once(name, e)
                raise
            raise PieceCompileError(
                f"Inductor failed to compile piece {name} ({variant.label}): {type(e).__name__}: {e}") from e
        finally:
            _current_variant.reset(token)
            elapsed = time.perf_counter() - start
            counters.compile_seconds += elapsed
        counters.inductor_compiles += 1
        counters.compiles_by_variant[variant.label] += 1
        log.debug("compiled piece %s (%s) in %.2f s", name, variant.label, elapsed)
        return artifact

    @staticmethod
    def _standalone_compile(gm: fx.GraphModule, example_inputs: Sequence[Any], variant: Variant, options: dict):
        if variant.kind == "size":
            # Real tensors of the first call at this size: Inductor specializes every shape.
            artifact = torch._inductor.standalone_compile(
                gm, list(example_inputs), dynamic_shapes="from_example_inputs", options=options)
        else:
            # Symbolic shapes of Dynamo's fake tensors, compiled in their own fake mode (not the
            # tracing context's: Dynamo gives backends a fresh mode on some versions).
            fake_mode = _fake_mode_of(example_inputs)
            if fake_mode is None:
                artifact = torch._inductor.standalone_compile(
                    gm, list(example_inputs), dynamic_shapes="from_graph", options=options)
            else:
                with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
                    artifact = torch._inductor.standalone_compile(
                        gm, list(example_inputs), dynamic_shapes="from_tracing_context", options=options)
        return artifact

    @staticmethod
    def serialize(artifact) -> bytes | None:
        """The artifact as bytes, or None when Inductor could not make it saveable."""
        with tempfile.TemporaryDirectory(prefix="torch_ext_save_") as tmp:
            path = os.path.join(tmp, "artifact.bin")
            try:
                artifact.save(path=path, format="binary")
            except Exception as e:  # e.g. unpicklable constants: keep it in memory only
                # Said once: torch 2.9.1 cannot save any piece that needs gradients (its AOTAutograd
                # entry is missing from the artifact), and a model has many.
                level = logging.DEBUG if InductorCompiler._said_unsaveable else logging.WARNING
                InductorCompiler._said_unsaveable = True
                why = "" if compat.TRAINING_ARTIFACTS_SAVEABLE or not torch.is_grad_enabled() else (
                    f"torch {torch.__version__} cannot save a piece that needs gradients; ")
                detail = str(e)
                if len(detail) > 200:  # 2.9.1's prints a whole CacheInfo
                    detail = detail[:200] + "..."
                log.log(level, "torch_ext: a compiled piece cannot be saved to the cache (%s%s: %s); it is "
                        "recompiled in the next process (Inductor's own cache still applies). Further such "
                        "pieces are logged at DEBUG.", why, type(e).__name__, detail)
                return None
            with open(path, "rb") as f:
                return f.read()

    @staticmethod
    def deserialize(blob: bytes) -> Callable[..., Any]:
        with tempfile.TemporaryDirectory(prefix="torch_ext_load_") as tmp:
            path = os.path.join(tmp, "artifact.bin")
            with open(path, "wb") as f:
                f.write(blob)
            start = time.perf_counter()
            artifact = torch._inductor.CompiledArtifact.load(path=path, format="binary")
            counters.load_seconds += time.perf_counter() - start
            return artifact
