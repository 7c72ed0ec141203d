"""Pass / PassManager: identity (uuid) for the compile cache, per-size gating, order, errors."""
import importlib.util
import pickle
import subprocess
import sys

import pytest
import torch
import torch.fx

from torch_ext.backend.passes import FuseAddRMSNormPass, Pass, PassManager

PASS_SOURCE = """
import torch
from torch_ext.backend.passes import Pass


class NegToAbs(Pass):
    def __init__(self, only_sizes=None):
        self.only_sizes = only_sizes

    def config(self):
        return {"only_sizes": self.only_sizes}

    def is_applicable(self, compile_size):
        return self.only_sizes is None or compile_size in self.only_sizes

    def __call__(self, graph):
        for n in graph.find_nodes(op="call_function", target=torch.ops.aten.neg.default):
            n.target = BODY
"""


@pytest.fixture
def load_pass(tmp_path, monkeypatch):
    """Import a pass from a fresh file: a stand-in for editing the pass between two runs."""

    def load(module_name, body="torch.ops.aten.abs.default"):
        path = tmp_path / f"{module_name}.py"
        path.write_text(PASS_SOURCE.replace("BODY", body))
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, module_name, module)  # inspect finds classes through it
        spec.loader.exec_module(module)
        return module.NegToAbs

    return load


def neg_graph():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.ops.aten.neg.default, (x,)))
    return g


def targets(graph):
    return [n.target for n in graph.nodes if n.op == "call_function"]


def test_uuid_stable_for_unchanged_pass(load_pass):
    # Same source in two modules (two class objects): same identity; it depends on content only.
    a, b = load_pass("pass_a"), load_pass("pass_b")
    assert a().uuid() == b().uuid() == a().uuid()
    assert PassManager([a()], compile_size=4).uuid() == PassManager([b()], compile_size=4).uuid()


def test_uuid_same_in_a_fresh_process():
    code = (
        "from torch_ext.backend.passes import FuseAddRMSNormPass, PassManager;"
        "print(PassManager([FuseAddRMSNormPass()], compile_size=8).uuid())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == PassManager([FuseAddRMSNormPass()], compile_size=8).uuid()


def test_uuid_changes_with_source_config_and_order(load_pass):
    v1 = load_pass("pass_v1")
    v2 = load_pass("pass_v2", body="torch.ops.aten.relu.default")  # edited pass
    assert v1().uuid() != v2().uuid()
    assert v1().uuid() != v1(only_sizes=[4]).uuid()
    base = PassManager([v1(), FuseAddRMSNormPass()]).uuid()
    assert PassManager([v2(), FuseAddRMSNormPass()]).uuid() != base
    assert PassManager([FuseAddRMSNormPass(), v1()]).uuid() != base
    assert PassManager([v1(), FuseAddRMSNormPass(skip_graph_inputs=True)]).uuid() != base
    assert PassManager([v1(), FuseAddRMSNormPass(dtypes=[torch.bfloat16])]).uuid() != base
    assert PassManager([v1(), FuseAddRMSNormPass()]).uuid() == base


def test_gating_by_compile_size(load_pass):
    v1 = load_pass("pass_gate_v1")
    v2 = load_pass("pass_gate_v2", body="torch.ops.aten.relu.default")
    for size, runs in ((4, True), (8, False), (None, False)):
        g = neg_graph()
        PassManager([v1(only_sizes=[4])], compile_size=size)(g)
        assert (torch.ops.aten.abs.default in targets(g)) is runs
    # A pass that does not run for a size is not part of that size's identity.
    assert (
        PassManager([v1(only_sizes=[4])], compile_size=8).uuid()
        == PassManager([v2(only_sizes=[4])], compile_size=8).uuid()
        == PassManager([], compile_size=8).uuid()
    )
    assert (
        PassManager([v1(only_sizes=[4])], compile_size=4).uuid()
        != PassManager([v2(only_sizes=[4])], compile_size=4).uuid()
    )


def test_runs_in_order(load_pass):
    calls = []

    class Record(Pass):
        def __init__(self, tag):
            self.tag = tag

        def __call__(self, graph):
            calls.append(self.tag)

    to_abs = load_pass("pass_order")
    g = neg_graph()
    PassManager([Record("first"), to_abs(), Record("last")])(g)
    assert calls == ["first", "last"] and torch.ops.aten.abs.default in targets(g)


def test_errors_name_the_pass():
    class Breaks(Pass):
        def __call__(self, graph):
            (neg,) = graph.find_nodes(op="call_function", target=torch.ops.aten.neg.default)
            with graph.inserting_before(neg):  # reads neg before its definition
                graph.call_function(torch.ops.aten.abs.default, (neg,))

    with pytest.raises(TypeError, match="Pass instances"):
        PassManager([lambda g: None])
    with pytest.raises(TypeError, match="compile_size"):
        PassManager([], compile_size="4")
    with pytest.raises(RuntimeError, match="before it has been defined") as info:
        PassManager([Breaks()], compile_size=2)(neg_graph())
    assert any("post-grad pass" in note and "Breaks" in note for note in info.value.__notes__)

    class BadConfig(Pass):
        def config(self):
            return {"fn": print}

        def __call__(self, graph):
            pass

    with pytest.raises(TypeError, match="JSON"):
        BadConfig().uuid()
    no_source = type("NoSource", (Pass,), {"__call__": lambda self, g: None})
    with pytest.raises(RuntimeError, match="cannot read the source"):
        no_source().uuid()


def test_pickles_with_the_same_identity():
    manager = PassManager([FuseAddRMSNormPass()], compile_size=2)
    manager(neg_graph())  # builds the pattern registry, which must not travel
    clone = pickle.loads(pickle.dumps(manager))
    assert clone.uuid() == manager.uuid()
    assert repr(clone).startswith("PassManager([FuseAddRMSNormPass(dtypes=")


def test_a_users_own_post_pass_runs_after_ours_and_keys_the_manager(load_pass):
    """CompileConfig.inductor_options' post_grad_custom_post_pass (`then`) runs after our passes, never
    instead of them; its uuid joins ours, and a pass without one leaves the manager without one."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    seen = []

    class UserPass(CustomGraphPass):
        def __init__(self, version):
            self.version = version

        def __call__(self, graph):
            seen.append(targets(graph))

        def uuid(self):
            return f"user-pass-{self.version}"

    to_abs = load_pass("pass_then")
    g = neg_graph()
    manager = PassManager([to_abs()], then=UserPass(1))
    manager(g)
    assert seen == [[torch.ops.aten.abs.default]]  # ours ran first
    alone = PassManager([to_abs()]).uuid()
    assert manager.uuid() not in (None, alone)
    assert manager.uuid() != PassManager([to_abs()], then=UserPass(2)).uuid()
    assert PassManager([to_abs()], then=lambda graph: None).uuid() is None  # a plain function: no key
    hashed = UserPass(3)
    hashed.uuid = lambda: b"\x00bytes"  # Inductor's get_hash_for_files gives bytes
    assert PassManager([to_abs()], then=hashed).uuid() is not None
    with pytest.raises(TypeError, match="then takes callable post-grad passes"):
        PassManager([], then="not a pass")
    seen.clear()
    listed = PassManager([], then=[UserPass(1), UserPass(2)])  # a list, as newer torch takes
    listed(neg_graph())
    assert len(seen) == 2 and listed.uuid() not in (None, PassManager([], then=[UserPass(1)]).uuid())
    assert PassManager([], then=[UserPass(1), lambda graph: None]).uuid() is None
