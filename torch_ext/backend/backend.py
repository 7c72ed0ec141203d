"""The Dynamo backend: Dynamo graph -> split -> per-piece compile -> per-shape runners.

Returns the split graph module, whose compute pieces are replaced by `CompiledPiece` runners and
whose splitting ops run eagerly between them. Training works: compiled pieces carry AOTAutograd
backward graphs, and splitting ops use their own autograd formulas.
"""
from __future__ import annotations

import logging
import operator
import os
import time
import weakref

import torch
import torch.fx as fx

from torch_ext import compat
from torch_ext.install import install, is_installed
from torch_ext.backend import dump
from torch_ext.backend.compile.first_use import libraries_needed, load_libraries
from torch_ext.backend.compile.builder import VariantBuilder
from torch_ext.backend.compile.cache import ArtifactStore, UnsafeCacheDirError, ensure_private_dir, model_key
from torch_ext.backend.compile.compiler import InductorCompiler
from torch_ext.backend.compile.stack_room import with_stack_room
from torch_ext.backend.rewrite.attention_mask import additive_attention_masks
from torch_ext.backend.rewrite.decode import decode_rewrites
from torch_ext.backend.rewrite.merge_projections import MergePlan, merge_projections
from torch_ext.backend.runtime.checkpoint import CheckpointedRegion
from torch_ext.backend.runtime.cudagraph.buffer_stores import expect_transformed_code
from torch_ext.backend.runtime.cudagraph.manager import CudaGraphManager
from torch_ext.backend.config import CompileConfig
from torch_ext.backend.joint import JointCompiler, why_not_joint
from torch_ext.backend.counters import counters
from torch_ext.backend.compile.environment import environment_factors
from torch_ext.backend.runtime.merged_params import MergedParams
from torch_ext.backend.runtime.piece_group import PieceGroup
from torch_ext.backend.runtime.piecewise import batch_symbol
from torch_ext.backend.runtime.split_runner import run_straight_line
from torch_ext.backend.runtime.summary import GraphRecord
from torch_ext.backend.split.matcher import SplittingOpMatcher
from torch_ext.backend.split.splitter import INLINABLE_HOPS, Checkpoint, SplitGraph, hop_name, split_graph
from torch_ext.backend.unused_config import UnusedConfigReporter

log = logging.getLogger("torch_ext.backend")


class TorchExtBackend:
    """A Dynamo backend: `torch.compile(model, backend=TorchExtBackend(config))`."""

    def __init__(self, config: CompileConfig | None = None):
        # Models bring nested_compile_region layers: trace them with torch_ext's VariableTrackers
        # (torch's own reuse path crashes on dynamic shapes) and avoid torch's known wrong results.
        if config is not None and not isinstance(config, CompileConfig):
            hint = f"torch_ext.backend(CompileConfig(**{config!r}))" if isinstance(config, dict) else \
                "torch_ext.backend(CompileConfig(...))"
            raise TypeError(f"torch_ext backend: config must be a torch_ext.CompileConfig, got "
                            f"{type(config).__name__} {config!r}. Write {hint}")
        if not is_installed():
            log.info("torch_ext: the torch_ext backend calls torch_ext.install()")
            install()
        self.config = config if config is not None else CompileConfig()
        self.matcher = SplittingOpMatcher(self.config.splitting_ops)
        compiler = InductorCompiler(self.config)
        self.compiler = compiler
        self.builder = VariantBuilder(compiler)
        self.joint = JointCompiler(self.config, self.matcher, compiler.patches)
        self._said_per_piece: set[str] = set()
        self.cudagraphs = CudaGraphManager(self.config) if self.config.cudagraph_mode != "none" else None
        self._graphs = 0
        self.unused_config = UnusedConfigReporter(self.config, self.matcher)
        self.last_store_key: str | None = None  # the piece cache's directory key of the last graph
        self.last_libraries: tuple[str, ...] = ()  # first-use libraries the last graph calls (compile/first_use.py)
        self._said_warm = False
        self.warm_start_used = False  # set by torch_ext.compile when it serves warm starts (warm_start/program.py)
        # What each graph compiled into (runtime/summary.py), held weakly: a record lives with its graph.
        self._records: list[weakref.ref] = []
        if self.config.cache_dir and os.path.exists(self.config.cache_dir):
            ensure_private_dir(self.config.cache_dir)  # refuse an unsafe directory early

    def __repr__(self) -> str:
        return f"TorchExtBackend({self.config})"

    def __call__(self, gm: fx.GraphModule, example_inputs, *, store_key: str | None = None,
                 rewritten: bool = False, plan: MergePlan | None = None) -> fx.GraphModule:
        """Compile a Dynamo graph. `store_key`: the piece cache's directory key saved with a warm-start
        entry (warm_start/program.py), where no Dynamo trace is there to derive it from. `rewritten`:
        gm is already the result of `self.rewrite` (warm start saves that graph), whose plan is `plan`."""
        # On a stack chunk with room: how deep Dynamo called us must not decide the compile's speed.
        return with_stack_room(self._compile, gm, example_inputs, store_key=store_key, rewritten=rewritten, plan=plan)

    def _compile(self, gm: fx.GraphModule, example_inputs, *, store_key: str | None, rewritten: bool,
                 plan: MergePlan | None):
        if (self.config.warm_start or self.config.background_compile) and not self.warm_start_used \
                and not self._said_warm:
            self._said_warm = True
            asked = " and ".join(f"CompileConfig.{f}" for f in ("warm_start", "background_compile")
                                 if getattr(self.config, f))
            log.warning("torch_ext: %s applies to torch_ext.compile(model, config); torch.compile(model, "
                        "backend=...) traces the model again in every process and compiles at the call.", asked)
        _pin_triton_environment()
        floats = compat.floats_to_specialize(example_inputs)
        if floats:
            read = _symbols_read(gm)
            floats = [name for name in floats if name in read]
        if floats:
            # Pieces are compiled apart, some with real tensors of one size, where a Python float
            # read back from a 0-d tensor input cannot stay symbolic: trace again with it constant.
            log.info("torch_ext: specializing Python float inputs %s (Dynamo traces the frame again)", floats)
            compat.restart_with_floats_specialized(floats)
        start = time.perf_counter()
        before = counters.snapshot()
        index = self._graphs
        self._graphs += 1
        counters.graphs_seen += 1
        dumper = dump.DebugDumper(self.config.debug_dump_dir, index) if self.config.debug_dump_dir else None
        if dumper:
            dumper.graph("dynamo_graph.py", gm, "the graph Dynamo handed to the torch_ext backend")

        if torch.is_grad_enabled() and any(isinstance(v, torch.Tensor) and v.requires_grad for v in example_inputs):
            why_not = why_not_joint(gm, self.matcher, self.config)
            if why_not is None:
                return self._compile_joint(gm, example_inputs, index, dumper, start, store_key)
            if why_not not in self._said_per_piece:
                self._said_per_piece.add(why_not)
                log.warning("torch_ext: training graph %d runs the split-per-piece path (each piece "
                            "differentiated on its own, slower than Inductor's step): %s", index, why_not)

        if not rewritten:
            gm, plan = self.rewrite(gm)
        if plan is not None and dumper:
            dumper.write("merged_projections.txt", plan.describe())
            dumper.graph("merged_graph.py", gm, "the Dynamo graph with its projections merged")

        store = self._store(gm, store_key)
        self.last_store_key = store.key if store is not None else None
        # Libraries its first call would load (cuDNN attention: 1.5 s), loaded here: with background
        # compile, on the compile thread. A loaded graph has no example values inside its pieces: warm
        # start saves the names (saved_graph.py).
        self.last_libraries = libraries_needed(gm) if not torch.is_grad_enabled() else ()
        load_libraries(self.last_libraries)
        group = PieceGroup(f"graph {index}", self.config, self.builder, store, batch_symbol(gm))
        # While autograd records, checkpoint regions stay regions (their recompute survives the split).
        split = split_graph(gm, self.matcher, self.config.hop_split, keep_checkpoints=torch.is_grad_enabled())
        graph_info = None
        if self.cudagraphs is not None:
            graph_info = self.cudagraphs.prepare(gm, self.matcher, f"graph {index}")
            # Module state assigned by the frame (not in the graph) would move what graphs read in place.
            expect_transformed_code(f"cudagraph_mode={self.config.cudagraph_mode!r}")
        self._install_runners(split, group, dumper)
        self.unused_config.graph(gm, index, group, split.split_gm)
        self._compile_general(group)

        dump.trace_artifact("torch_ext_split_graph", lambda: dump.readable(split.split_gm))
        if dumper:
            dumper.graph("split_graph.py", split.split_gm, "pieces called in order; splitting ops run eagerly")
        counters.backend_seconds += time.perf_counter() - start
        after = counters.snapshot()
        log.info(
            "torch_ext: graph %d split into %d compute pieces (%d unique) around %d splitting ops; "
            "%d Inductor compiles, %d cache hits in %.2f s",
            index, group.occurrences, len(group.pieces), group.splitting_ops,
            after["inductor_compiles"] - before["inductor_compiles"],
            after["cache_hits"] - before["cache_hits"], time.perf_counter() - start)
        compiled = split.split_gm
        runner_groups = len(self.cudagraphs.groups) if self.cudagraphs is not None else 0
        if self.cudagraphs is not None:  # piecewise: wraps the pieces in place; full: wraps the split graph
            compiled = self.cudagraphs.wrap(split, graph_info)
        else:  # no module calls between pieces; CPU graphs one call at a time (runtime/serial_calls.py)
            run_straight_line(split.split_gm, f"graph {index}", serial=_on_cpu(example_inputs))
        self._record(split.split_gm, GraphRecord(
            "inference", self.compiler, group, plan, tuple(self.cudagraphs.groups[runner_groups:])
            if self.cudagraphs is not None else (), self.cudagraphs))
        if plan is None:
            return compiled
        counters.merged_projection_groups += len(plan.groups)
        merged = MergedParams(compiled, plan, f"graph {index}")
        merged.bind(example_inputs)  # the parameters become views of the buffers now
        return merged

    def _compile_joint(self, gm: fx.GraphModule, example_inputs, index: int, dumper, start: float,
                       store_key: str | None):
        """A training graph, differentiated once and split after AOTAutograd (joint.py)."""
        store = self._store(gm, store_key)  # refuses an unsafe cache dir; Inductor's own cache serves the pieces
        self.last_store_key = store.key if store is not None else None
        compiled = self.joint.compile(gm, example_inputs, f"graph {index}", dumper)
        self._record(compiled, GraphRecord("training", self.compiler))
        self.unused_config.training_graph(gm, index, compiled)
        counters.backend_seconds += time.perf_counter() - start
        log.info("torch_ext: training graph %d differentiated once and split in %.2f s", index,
                 time.perf_counter() - start)
        return compiled

    def describe(self) -> list[dict]:
        """What each graph this backend compiled (and that is still alive) is, in compile order
        (runtime/summary.py): two processes running one program describe it alike."""
        return [record.describe() for record in (ref() for ref in self._records) if record is not None]

    def _record(self, holder, record: GraphRecord) -> None:
        try:
            holder.torch_ext_record = record  # the holder keeps it alive; the backend only looks
        except AttributeError:
            return
        self._records = [ref for ref in self._records if ref() is not None] + [weakref.ref(record)]

    def rewrite(self, gm: fx.GraphModule) -> tuple[fx.GraphModule, MergePlan | None]:
        """The Dynamo graph the stages after it see (rewrite/): in inference graphs (grad off), a copy
        with its projections merged, and the plan of the buffers it takes after its own inputs; decode
        SDPA calls run torch_ext::decode_attention, linears of a few rows torch_ext::decode_linear; splitting-op
        SDPA calls take their bool masks made additive in the graph."""
        # Before the rewrites: kernel tuning compiles our Triton kernels, and warm start saves the graph
        # it rewrites before _compile sees it.
        _pin_triton_environment()
        if torch.is_grad_enabled():
            return gm, None
        plan = None
        if self.config.merge_projections:
            merged = merge_projections(gm)
            if merged is not None:
                gm, plan = merged
        # In place (no placeholder changes): Dynamo reads only the placeholders after we return.
        is_splitting = lambda n: self.matcher.match(n) is not None  # noqa: E731
        decode_rewrites(gm, self.config, is_splitting)
        if self.config.additive_attention_masks:
            counters.additive_attention_masks += additive_attention_masks(gm, is_splitting)
        return gm, plan

    def _store(self, gm: fx.GraphModule, key: str | None = None) -> ArtifactStore | None:
        if not self.config.cache_dir:
            return None
        traced = torch._guards.TracingContext.get_traced_code() or []
        files = [code.co_filename for code in traced]
        try:
            key = key or model_key(self.config.artifact_hash(), files, environment_factors(gm))
            return ArtifactStore(self.config.cache_dir, key)
        except UnsafeCacheDirError:
            raise
        except OSError as e:  # e.g. a read-only home: compile without the disk cache
            log.warning("torch_ext: cannot use cache dir %s (%s); compiling without a disk cache",
                        self.config.cache_dir, e)
            return None

    def _install_runners(self, split: SplitGraph, group: PieceGroup, dumper, done: dict | None = None) -> None:
        """Point every piece call of the split graph at its runner (recursing into split HOP bodies)."""
        done = {} if done is None else done
        if id(split) in done:  # a body shared by several call sites
            return
        top_level = not done
        prefix = done[id(split)] = f"body{len(done)}_" if done else ""
        for position, piece in enumerate(split.pieces):
            if piece.kind == "splitting":
                group.splitting_ops += 1
                if piece.checkpoint is not None:  # in a selective checkpoint region: run under its policy
                    checkpoint = piece.checkpoint
                    setattr(split.split_gm, piece.name, CheckpointedRegion(
                        piece.graph_module, checkpoint.options, checkpoint.where, checkpoint.context_fn))
                continue
            if piece.kind == "hop":
                self._install_runners(piece.body, group, dumper, done)
                body = piece.body.split_gm
                if piece.checkpoint is not None:
                    body = self._checkpoint_region(piece.checkpoint, body, group)
                _call_split_body(piece.graph_module, piece.hop_node, body)
                continue
            group.occurrences += 1
            runner = group.piece_for(piece.name, piece.graph_module, position)
            if dumper:
                note = "runs as plain Python (nothing to compile)" if runner is None else \
                    f"fingerprint {runner.fingerprint[:16]}, runs as {runner.name} of {group.name}"
                dumper.graph(os.path.join("pieces", f"{prefix}{piece.name}.py"), piece.graph_module, note)
            if runner is not None:
                runner.check_layouts(self._made_inside(split, piece.name, top_level))
                # The split graph calls `self.<name>(...)`; an instance attribute replaces the submodule.
                delattr(split.split_gm, piece.name)
                split.split_gm.__dict__[piece.name] = runner

    def _checkpoint_region(self, checkpoint: Checkpoint, body: fx.GraphModule, group: PieceGroup):
        """What a kept checkpoint region's call site runs: its split body under torch.utils.checkpoint,
        or, for a selective one, the body itself (its pieces and splitting ops carry the policy)."""
        group.checkpoint_regions += 1
        if checkpoint.context_fn is not None:
            return body
        return CheckpointedRegion(body, checkpoint.options, checkpoint.where)

    def _made_inside(self, split: SplitGraph, name: str, top_level: bool) -> dict[int, str]:
        """Arguments of the call of piece `name` that are made inside the graph, with what makes them
        (the graph's own inputs are guarded by Dynamo; a split HOP body's inputs are not)."""
        call = next(n for n in split.split_gm.graph.nodes if n.op == "call_module" and n.target == name)
        kinds = {p.name: p for p in split.pieces}
        made = {}
        for i, arg in enumerate(call.args):
            source = arg.args[0] if isinstance(arg, fx.Node) and arg.target is operator.getitem else arg
            if not isinstance(source, fx.Node) or (source.op == "placeholder" and top_level):
                continue
            producer = kinds.get(source.target) if source.op == "call_module" else None
            if producer is not None and producer.kind == "splitting":
                ops = (self.matcher.match(n) for n in producer.graph_module.graph.nodes)
                made[i] = next((op for op in ops if op), f"splitting op {producer.name}")
            elif producer is not None:
                made[i] = f"piece {producer.name} (Inductor)"
            else:
                made[i] = f"{source.op} {source.target}"
        return made

    def _compile_general(self, group: PieceGroup) -> None:
        group.compile_general()
        # Counted once the graph is compiled: an attempt Dynamo restarts does not count.
        counters.pieces += group.occurrences
        counters.unique_pieces += len(group.pieces)
        counters.splitting_op_calls += group.splitting_ops
        counters.checkpoint_regions += group.checkpoint_regions


def _pin_triton_environment() -> None:
    """Cold and warm processes keep Triton's files in one place and compile under the same keys
    (compat.pin_triton_cache_dir and pin_triton_ptxas say why), set before anything of ours compiles or
    loads a Triton kernel."""
    device = _gpu_device()
    if device is not None:
        compat.pin_triton_cache_dir(device)
        compat.pin_triton_ptxas()


def _gpu_device() -> int | None:
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def _on_cpu(example_inputs) -> bool:
    """Every tensor the graph takes is on the CPU (and it takes one)."""
    devices = {v.device.type for v in example_inputs if isinstance(v, torch.Tensor)}
    return devices == {"cpu"}


def _symbols_read(gm: fx.GraphModule) -> set[str]:
    """Names of the symbols in the graph's values. A graph loaded for a warm start was traced with its
    floats specialized already, though its shape env still knows their symbols."""
    names: set[str] = set()
    for node in gm.graph.nodes:
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            names.update(str(s) for s in value.node.expr.free_symbols)
    return names


def _call_split_body(partition: fx.GraphModule, hop_node_name: str, body_split: fx.GraphModule) -> None:
    """In a partition holding one HOP call, call the split body instead (in_body mode)."""
    graph = partition.graph
    hop = next(n for n in graph.nodes if n.name == hop_node_name)
    body_index, first_operand = INLINABLE_HOPS[hop_name(hop)]
    partition.add_submodule("split_body", body_split)
    with graph.inserting_before(hop):
        call = graph.call_module("split_body", tuple(hop.args[first_operand:]))
    call.meta = dict(hop.meta)
    hop.replace_all_uses_with(call)
    body_attr = hop.args[body_index]
    graph.erase_node(hop)
    if isinstance(body_attr, fx.Node) and not body_attr.users:
        graph.erase_node(body_attr)
    partition.recompile()
