"""The differential harness (tests/differential.py): every program of tests/hop_corpus.py compiled by
vanilla torch and under torch_ext.install() in this torch. Fails on "worse": torch compiles a program
and torch_ext does not, or not the same way (a different Dynamo graph), or torch_ext is wrong."""
import pytest

import torch_ext
from differential import compare
from hop_corpus import PROGRAMS

# HOP tracing is where torch versions differ most: these run on every CI torch, never sharded.
pytestmark = pytest.mark.every_version


def _check(name, backend):
    verdict, vanilla, ours = compare(PROGRAMS[name], backend)
    assert verdict != "worse", (f"{name} on {backend}: torch {vanilla.status} ({vanilla.detail}), "
                                f"torch_ext {ours.status} ({ours.detail})")
    return verdict, vanilla, ours


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_never_worse_than_torch(name, backend):
    _check(name, backend)


# Inductor compiles C++ on CPU: a representative subset runs unmarked, the whole corpus as slow.
INDUCTOR_SUBSET = ["region_list_append", "region_output_view_of_input", "checkpoint_dataclass_output",
                   "region_buffer_operand_dynamic"]


@pytest.mark.parametrize("name", INDUCTOR_SUBSET)
def test_never_worse_than_torch_on_inductor(name):
    _check(name, "inductor")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(PROGRAMS) - set(INDUCTOR_SUBSET)))
def test_never_worse_than_torch_on_inductor_whole_corpus(name):
    _check(name, "inductor")


def test_region_side_effects_on_caller_list_compile_on_every_torch():
    # Issue 50's program: torch 2.15 compiles it; older torch refuses, torch_ext compiles it there too.
    verdict, vanilla, ours = _check("region_list_append", "aot_eager")
    assert ours.status == "ok"
    assert verdict == ("same" if vanilla.status == "ok" else "better")
    assert not torch_ext.is_installed()
