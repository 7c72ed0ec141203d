"""Process-wide counters of what the backend did, for tests and for logs."""
from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class BackendCounters:
    graphs_seen: int = 0  # Dynamo graphs handed to the backend
    pieces: int = 0  # compiled (non-splitting) pieces, over all graphs
    unique_pieces: int = 0  # distinct piece graphs among them
    splitting_op_calls: int = 0  # splitting-op nodes left to run eagerly between pieces
    # Training graphs AOTAutograd differentiated whole, then split (backend/joint.py).
    joint_graphs: int = 0
    # Inputs of training pieces checked (and copied where needed) into their compiled layout at each call,
    # since the piece making them returns them with other strides than their fakes (runtime/layout.py)
    relaid_inputs: int = 0
    # training_cudagraphs="whole": split training graphs replayed as one CUDA graph each (runtime/graphed_whole.py)
    graphed_whole: int = 0
    # training_cudagraphs: .grad tensors still in the CUDA-graph pool at the next forward, copied out
    # (runtime/pool_gradients.py; gradient accumulation across micro-batches).
    pool_gradients_moved: int = 0
    inlined_hops: int = 0  # HOP calls inlined because their body holds a splitting op
    # Activation-checkpoint regions holding a splitting op, kept as regions in training (recomputed in
    # backward: split/checkpoint.py).
    checkpoint_regions: int = 0
    # Groups of projections sharing an input merged into one GEMM (rewrite/merge_projections.py).
    merged_projection_groups: int = 0
    # Bytes of the buffers behind them (runtime/merged_params.py): the parameters' storage, not a copy.
    merged_buffer_bytes: int = 0
    # decode_linear shapes whose kernel was chosen by timing in this process (kernels/decode_linear_tuning.py).
    tuned_shapes: int = 0
    decode_linear_calls: int = 0  # linear calls of a few rows replaced by torch_ext::decode_linear
    decode_linear_fusions: int = 0  # norms, gates and residual adds folded into those calls
    additive_attention_masks: int = 0  # splitting-op SDPA calls given their bool mask made additive in the graph
    decode_attention_calls: int = 0  # SDPA calls of one query token replaced by torch_ext::decode_attention
    inductor_compiles: int = 0  # standalone_compile calls
    cache_hits: int = 0  # variants loaded from the disk cache
    cache_misses: int = 0  # variants looked for on disk and not found
    cache_damaged: int = 0  # entries that failed the integrity check (then recompiled)
    backend_seconds: float = 0.0  # wall time in the backend call (split, compile or load, install)
    compile_seconds: float = 0.0  # wall time inside Inductor (also lazy per-size compiles)
    load_seconds: float = 0.0  # wall time loading cached artifacts
    # Warm start (backend/warm_start/): programs loaded without tracing, saved after a trace, and
    # calls that went through torch.compile instead (no entry usable, or inputs it was not saved for).
    warm_start_loads: int = 0
    warm_start_saves: int = 0
    warm_start_fallbacks: int = 0
    warm_start_seconds: float = 0.0  # wall time finding programs: loading them, or tracing and saving
    # CompileConfig.background_compile (warm_start/background.py): calls run eagerly while their program
    # was on its way, and programs looked for on the compile thread.
    background_eager_calls: int = 0
    background_compiles: int = 0
    # Inductor compiles per variant: "general", "size=8", "range=[1,16)".
    compiles_by_variant: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def reset(self) -> None:
        for field in dataclasses.fields(self):
            value = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
            setattr(self, field.name, value)

    def snapshot(self) -> dict:
        out = dataclasses.asdict(self)
        out["compiles_by_variant"] = dict(self.compiles_by_variant)
        return out


counters = BackendCounters()
