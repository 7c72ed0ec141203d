"""A separate process for the cache tests: compile the toy decoder into a cache dir, check it
against eager, print the backend counters as JSON on the last line.

    python tests/backend_worker.py CACHE_DIR [--layers N] [--sizes 4,6] [--compile-sizes 4]
                                             [--barrier DIR --parties N] [--hang-before-commit]

--barrier/--parties: wait until N workers reach the first call, so they compile together.
--hang-before-commit: on the first cache write, print HANGING and stop after the artifact bytes
are on disk but before they are renamed into place (the parent then SIGKILLs us).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import backend_models as bm
from torch_ext.backend import CompileConfig, counters, make_backend


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cache_dir")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--sizes", default="4,6")
    parser.add_argument("--compile-sizes", default="4")
    parser.add_argument("--barrier", default=None)
    parser.add_argument("--parties", type=int, default=1)
    parser.add_argument("--hang-before-commit", action="store_true")
    args = parser.parse_args()

    if args.hang_before_commit:
        import torch_ext.backend.compile.cache as cache

        real_fsync = os.fsync

        def hang(fd):
            caller = sys._getframe(1).f_code
            if caller.co_name == "write" and caller.co_filename == cache.__file__:
                print("HANGING", flush=True)
                time.sleep(600)
            real_fsync(fd)

        cache.os.fsync = hang  # ArtifactStore.write fsyncs the temp file right before os.replace

    cfg = CompileConfig(splitting_ops=["torch_ext_test::attention"], cache_dir=args.cache_dir,
                        compile_sizes=[int(s) for s in args.compile_sizes.split(",") if s])
    model = bm.Decoder(layers=args.layers)
    compiled = torch.compile(model, backend=make_backend(cfg))
    if args.barrier:
        open(os.path.join(args.barrier, f"ready.{os.getpid()}"), "w").close()
        deadline = time.time() + 120
        while len(os.listdir(args.barrier)) < args.parties and time.time() < deadline:
            time.sleep(0.05)

    worst = 0.0
    eager_caches, compiled_caches = model.caches(), model.caches()
    for i, n in enumerate(int(s) for s in args.sizes.split(",")):
        x = bm.batch(n, seed=i, dynamic=(i == 0))
        with torch.no_grad():
            expected = model(x, eager_caches)
            actual = compiled(x, compiled_caches)
        worst = max(worst, (actual - expected).abs().max().item(),
                    *((a - b).abs().max().item() for a, b in zip(compiled_caches, eager_caches)))
    print(json.dumps({"pid": os.getpid(), "max_error": worst, "counters": counters.snapshot()}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
