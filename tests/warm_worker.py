"""A separate process for the warm-start tests: torch_ext.compile the toy decoder with a cache dir,
call it at a few batch sizes, check against eager, print JSON on the last line (counters, Dynamo's
own frame count, the outputs).

    python tests/warm_worker.py CACHE_DIR [--layers N] [--sizes 4,6] [--guard-free] [--fx-pieces] [--no-warm]
                                          [--barrier DIR --parties N] [--hang-before-commit]
                                          [--compile-sizes 9] [--gelu] [--dynamic]

--fx-pieces: pieces run as FX graphs (no Inductor: fast; they are not cached on disk).
--barrier/--parties: wait until N workers reach the first call, so they start together.
--gelu: a tanh-GELU head after the decoder (reads the global float math.pi, which Dynamo leaves
unspecialized under dynamic=True: the backend has Dynamo trace again with it specialized).
--dynamic: torch_ext.compile(..., dynamic=True).
--hang-before-commit: on the warm-start entry's write, print HANGING and stop after its bytes are
on disk but before they are renamed into place (the parent then SIGKILLs us).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

import backend_models as bm
import torch_ext
from torch_ext.backend import CompileConfig, counters


class GeluHead(torch.nn.Module):
    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder

    def caches(self):
        return self.decoder.caches()

    def forward(self, x, caches):
        h = self.decoder(x, caches)
        return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cache_dir")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sizes", default="4,6")
    parser.add_argument("--guard-free", action="store_true")
    parser.add_argument("--fx-pieces", action="store_true")
    parser.add_argument("--no-warm", action="store_true", help="CompileConfig.warm_start=False")
    parser.add_argument("--barrier", default=None)
    parser.add_argument("--parties", type=int, default=1)
    parser.add_argument("--hang-before-commit", action="store_true")
    parser.add_argument("--compile-sizes", default="", help="CompileConfig.compile_sizes, comma-separated")
    parser.add_argument("--gelu", action="store_true")
    parser.add_argument("--dynamic", action="store_true")
    args = parser.parse_args()

    from torch._inductor import codecache

    hashed_torch = []  # whether Inductor hashed torch's sources here (inductor_keys primes its key)
    real_hash = codecache.build_code_hash
    codecache.build_code_hash = lambda *a, **k: (hashed_torch.append(1), real_hash(*a, **k))[1]

    if args.fx_pieces:
        from torch_ext.backend.compile.compiler import InductorCompiler

        InductorCompiler.compile = lambda self, gm, example_inputs, variant, name="": gm
    if args.hang_before_commit:
        import torch_ext.backend.compile.cache as cache

        real_fsync = os.fsync

        def hang(fd):
            writer = sys._getframe(1)
            if writer.f_code.co_name == "write" and "warm_start" in writer.f_locals["self"].directory:
                print("HANGING", flush=True)
                time.sleep(600)
            real_fsync(fd)

        cache.os.fsync = hang  # ArtifactStore.write fsyncs the temp file right before os.replace

    cfg = CompileConfig(splitting_ops=["torch_ext_test::attention"], cache_dir=args.cache_dir,
                        guard_free_dispatch=args.guard_free, progress_bar=False,
                        warm_start=False if args.no_warm else None,
                        compile_sizes=[int(n) for n in args.compile_sizes.split(",") if n])
    model = bm.Decoder(layers=args.layers) if not args.gelu else GeluHead(bm.Decoder(layers=args.layers))
    compiled = torch_ext.compile(model, cfg, dynamic=True if args.dynamic else None)
    if args.barrier:
        open(os.path.join(args.barrier, f"ready.{os.getpid()}"), "w").close()
        deadline = time.time() + 120
        while len(os.listdir(args.barrier)) < args.parties and time.time() < deadline:
            time.sleep(0.05)

    worst, outputs = 0.0, []
    eager_caches, compiled_caches = model.caches(), model.caches()
    for i, n in enumerate(int(s) for s in args.sizes.split(",")):
        x = bm.batch(n, seed=i, dynamic=(i == 0))
        with torch.no_grad():
            expected = model(x, eager_caches)
            actual = compiled(x, compiled_caches)
        outputs.append(actual.tolist())
        worst = max(worst, (actual - expected).abs().max().item(),
                    *((a - b).abs().max().item() for a, b in zip(compiled_caches, eager_caches)))
    frames = dict(torch._dynamo.utils.counters["frames"])
    print(json.dumps({"pid": os.getpid(), "max_error": worst, "counters": counters.snapshot(),
                      "dynamo_frames": frames, "outputs": outputs,
                      "hashed_torch_sources": bool(hashed_torch)}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
