"""Graph snapshots in a user's own test suite (issue 29): files beside the user's tests (or where the
suite says), never in the installed package; the inline form for expecttest; which torch version
writes the shared file; capture_graphs with and without the torch_ext backend."""
import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import torch

import torch_ext
from torch_ext import snapshots
from torch_ext.testing import assert_graph_snapshot, capture_graphs, graph_text, normalized_graph

PACKAGE_DIR = Path(torch_ext.__file__).resolve().parent
RUNNING = "{}.{}".format(*snapshots.parse_version(torch.__version__))


def _sin(x):
    return torch.sin(x) * 2


def _cos(x):
    return torch.cos(x) * 2


@pytest.fixture
def clean_env(monkeypatch):
    """No suite-wide snapshot settings (this repository's conftest sets some) and no ACCEPT."""
    for name in (snapshots.DIR_ENV, snapshots.OLD_DIR_ENV, snapshots.PRIMARY_ENV, "EXPECTTEST_ACCEPT"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# --- where snapshot files live


def test_folder_is_expected_beside_the_calling_test_file(clean_env, tmp_path):
    assert snapshots.snapshot_dir()[0] == Path(__file__).resolve().parent / "expected"
    clean_env.setenv(snapshots.OLD_DIR_ENV, str(tmp_path / "old"))
    assert snapshots.snapshot_dir()[0] == tmp_path / "old"
    clean_env.setenv(snapshots.DIR_ENV, str(tmp_path / "new"))  # the new name wins over the old one
    assert snapshots.snapshot_dir()[0] == tmp_path / "new"
    assert snapshots.snapshot_dir(tmp_path / "arg")[0] == tmp_path / "arg"  # and directory= over both


def test_missing_snapshot_names_the_file_and_why_that_folder(clean_env, tmp_path):
    gm = capture_graphs(_sin, torch.randn(4)).graphs[0]
    with pytest.raises(AssertionError, match=r"no snapshot .*user\.block\.txt \(folder: directory= argument\)"):
        assert_graph_snapshot("user.block", gm, directory=tmp_path)


def test_nothing_is_written_inside_the_package(clean_env, graphs):
    clean_env.setenv("EXPECTTEST_ACCEPT", "1")
    with pytest.raises(ValueError, match="inside the torch_ext package: keep"):
        assert_graph_snapshot("g", graphs["sin"], directory=PACKAGE_DIR / "expected")
    assert not (PACKAGE_DIR / "expected").exists()


# --- which torch version writes which file (other versions simulated by patching the running one)


@pytest.fixture
def graphs():
    return {"sin": capture_graphs(_sin, torch.randn(4)).graphs[0],
            "cos": capture_graphs(_cos, torch.randn(4)).graphs[0]}


def _accept_as(monkeypatch, version, gm, folder, primary=None):
    monkeypatch.setattr(snapshots, "_running", lambda: snapshots.parse_version(version))
    monkeypatch.setenv("EXPECTTEST_ACCEPT", "1")
    assert_graph_snapshot("g", gm, directory=folder, primary=primary)
    monkeypatch.delenv("EXPECTTEST_ACCEPT")


def _check_as(monkeypatch, version, gm, folder):
    monkeypatch.setattr(snapshots, "_running", lambda: snapshots.parse_version(version))
    assert_graph_snapshot("g", gm, directory=folder)


def _files(folder):
    return sorted(p.name for p in folder.iterdir())


def test_by_default_the_newest_torch_that_accepted_writes_the_shared_file(clean_env, tmp_path, graphs):
    sin, cos = graphs["sin"], graphs["cos"]
    _accept_as(clean_env, "2.13", sin, tmp_path)
    assert _files(tmp_path) == ["g.txt", "torch_versions.json"]
    _accept_as(clean_env, "2.15", cos, tmp_path)  # newer: takes the shared file over
    assert (tmp_path / "g.txt").read_text() == graph_text(cos)
    assert json.loads((tmp_path / "torch_versions.json").read_text()) == {"g": "2.15"}
    _accept_as(clean_env, "2.13", sin, tmp_path)  # older and different: a file of its own
    assert _files(tmp_path) == ["g.torch2.13.txt", "g.txt", "torch_versions.json"]
    assert (tmp_path / "g.txt").read_text() == graph_text(cos)
    _check_as(clean_env, "2.13", sin, tmp_path)
    _check_as(clean_env, "2.15", cos, tmp_path)
    _check_as(clean_env, "2.14", cos, tmp_path)  # no file of its own: the shared one
    with pytest.raises(AssertionError, match="graph differs from snapshot"):
        _check_as(clean_env, "2.14", sin, tmp_path)
    _accept_as(clean_env, "2.13", cos, tmp_path)  # prints what the shared file says: own file removed
    assert _files(tmp_path) == ["g.txt", "torch_versions.json"]


def test_a_chosen_primary_alone_writes_the_shared_file(clean_env, tmp_path, graphs):
    sin, cos = graphs["sin"], graphs["cos"]
    _accept_as(clean_env, "2.15", sin, tmp_path, primary="2.14")  # not the primary: its own file, even first
    assert _files(tmp_path) == ["g.torch2.15.txt"]
    clean_env.setenv(snapshots.PRIMARY_ENV, "2.14.1")  # the suite-wide choice, as an argument would
    _accept_as(clean_env, "2.14", cos, tmp_path)
    assert _files(tmp_path) == ["g.torch2.15.txt", "g.txt"]  # no version record with a chosen primary
    _accept_as(clean_env, "2.16", cos, tmp_path)  # newer, but the primary was chosen: the same, no file
    assert _files(tmp_path) == ["g.torch2.15.txt", "g.txt"]
    _check_as(clean_env, "2.15", sin, tmp_path)
    _check_as(clean_env, "2.16", cos, tmp_path)


# --- the inline form


def test_normalized_graph_reads_the_same_on_every_tested_torch():
    """The text pinned here is what torch 2.9.1, 2.11.0, 2.13.0, 2.14.1 and 2.15.0 all print (no source
    comments, blank lines or trailing spaces)."""
    def f(x, y):
        return torch.sin(x) * y + x.cos().sum(-1, keepdim=True)

    gm = capture_graphs(f, torch.randn(2, 4), torch.randn(2, 4), compile_options={"dynamic": True}).graphs[0]
    assert "# File:" in gm.print_readable(print_output=False)
    assert normalized_graph(gm) == textwrap.dedent('''\
        class GraphModule(torch.nn.Module):
            def forward(self, s77: "Sym(s77)", s27: "Sym(s27)", L_x_: "f32[s77, s27]", L_y_: "f32[s77, s27]"):
                l_x_ = L_x_
                l_y_ = L_y_
                sin: "f32[s77, s27]" = torch.sin(l_x_)
                mul: "f32[s77, s27]" = sin * l_y_;  sin = l_y_ = None
                cos: "f32[s77, s27]" = l_x_.cos();  l_x_ = None
                sum_1: "f32[s77, 1]" = cos.sum(-1, keepdim = True);  cos = None
                add: "f32[s77, s27]" = mul + sum_1;  mul = sum_1 = None
                return (add,)
        ''')


# --- capture_graphs


@pytest.mark.slow
def test_capture_graphs_with_the_backend_returns_the_split_graph_and_its_pieces():
    def f(x):
        return ((x.sin() @ x).softmax(-1) + 1).cos()

    x = torch.randn(4, 4)
    plain = capture_graphs(f, x)
    config = torch_ext.CompileConfig(splitting_ops=["aten::softmax"], cache_dir=None)
    captured = capture_graphs(f, x, backend_config=config)
    torch.testing.assert_close(captured.outputs, f(x))
    assert not torch_ext.is_installed()  # the backend installs torch_ext; capture_graphs undoes that
    assert graph_text(captured.graphs[0]) == graph_text(plain.graphs[0])
    (pieces,) = captured.pieces
    assert list(pieces) == ["submod_0", "submod_1", "submod_2"]
    assert "self.submod_1(submod_0)" in graph_text(captured.split_graphs[0])
    assert [n.target for n in pieces["submod_1"].graph.nodes if n.op == "call_method"] == ["softmax"]
    assert "sin @ l_x_" in graph_text(pieces["submod_0"])  # a compiled piece: the runner's graph
    assert "add.cos()" in graph_text(pieces["submod_2"])
    with pytest.raises(ValueError, match="cudagraph_mode='none'"):
        capture_graphs(f, x, backend_config=torch_ext.CompileConfig(cudagraph_mode="piecewise", cache_dir=None))


# --- a user's suite outside this repository, run by pytest in a subprocess

USER_TEST = """\
import torch
from torch_ext.testing import assert_graph_snapshot, capture_graphs


def block(x):
    return torch.sin(x) * 2


def test_block():
    assert_graph_snapshot("user_suite_block", capture_graphs(block, torch.randn(4)).graphs[0])
"""


def _package_tree_snapshots():
    """Snapshot files of the user suite anywhere torch_ext once wrote (the package's parent: the
    repository or site-packages) or could (the package)."""
    roots = {PACKAGE_DIR, PACKAGE_DIR.parent / "expected", Path(sysconfig.get_paths()["purelib"]) / "expected"}
    return {p for root in roots if root.exists()
            for pattern in ("user_suite_block*", "torch_versions.json") for p in root.rglob(pattern)}


def _run_pytest(folder, accept=False, env=None):
    """pytest in `folder` as a user runs it: none of this repository's snapshot settings."""
    full_env = {k: v for k, v in os.environ.items()
                if k not in (snapshots.DIR_ENV, snapshots.OLD_DIR_ENV, snapshots.PRIMARY_ENV, "EXPECTTEST_ACCEPT")
                and not k.startswith("PYTEST_")}
    full_env.update(env or {})
    if accept:
        full_env["EXPECTTEST_ACCEPT"] = "1"
    old_expected = PACKAGE_DIR.parent / "expected"
    mode = old_expected.stat().st_mode if old_expected.exists() else None
    try:
        if mode is not None:
            old_expected.chmod(0o555)  # read-only (no barrier for root: hence _package_tree_snapshots)
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=folder,
                                env=full_env, capture_output=True, text=True, timeout=300)
    finally:
        if mode is not None:
            old_expected.chmod(mode)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.slow
def test_user_suite_records_its_snapshot_beside_its_tests(tmp_path):
    tests = tmp_path / "project" / "tests"
    tests.mkdir(parents=True)
    (tmp_path / "project" / "pytest.ini").write_text("[pytest]\n")
    (tests / "test_user.py").write_text(USER_TEST)
    assert not _package_tree_snapshots()

    rc, out = _run_pytest(tmp_path / "project", accept=True)
    assert rc == 0, out
    assert _files(tests / "expected") == ["torch_versions.json", "user_suite_block.txt"]
    assert "torch.sin(l_x_)" in (tests / "expected" / "user_suite_block.txt").read_text()
    assert json.loads((tests / "expected" / "torch_versions.json").read_text()) == {"user_suite_block": RUNNING}
    assert not _package_tree_snapshots()

    rc, out = _run_pytest(tmp_path / "project")
    assert rc == 0, out

    (tests / "test_user.py").write_text(USER_TEST.replace("torch.sin(x)", "torch.cos(x)"))
    rc, out = _run_pytest(tmp_path / "project")
    assert rc == 1, out
    assert "graph differs from snapshot" in out
    assert '-        sin: "f32[4]" = torch.sin(l_x_)' in out and '+        cos: "f32[4]" = torch.cos(l_x_)' in out
    assert not _package_tree_snapshots()


@pytest.mark.slow
def test_user_suite_ini_options_choose_folder_and_primary(tmp_path):
    """With the plugin: the folder is relative to the ini file (pytest runs in tests/); a primary
    that is not the running torch leaves the running one its own file; TORCH_EXT_SNAPSHOT_PRIMARY
    overrides the ini option."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -p torch_ext.pytest_plugin\n"
                                         "torch_ext_snapshot_dir = snaps\n"
                                         "torch_ext_snapshot_primary_version = 1.0\n")
    (tmp_path / "tests" / "test_user.py").write_text(USER_TEST)
    own = f"user_suite_block.torch{RUNNING}.txt"

    rc, out = _run_pytest(tmp_path / "tests", accept=True)
    assert rc == 0, out
    assert _files(tmp_path / "snaps") == [own]
    assert not (tmp_path / "tests" / "expected").exists()
    rc, out = _run_pytest(tmp_path / "tests")
    assert rc == 0, out

    rc, out = _run_pytest(tmp_path / "tests", accept=True, env={snapshots.PRIMARY_ENV: RUNNING})
    assert rc == 0, out
    assert _files(tmp_path / "snaps") == ["user_suite_block.txt"]  # the primary's own file is dropped
    rc, out = _run_pytest(tmp_path / "tests")
    assert rc == 0, out
    assert not _package_tree_snapshots()


INLINE_TEST = '''\
import expecttest
import torch
from torch_ext.testing import capture_graphs, normalized_graph


def block(x):
    return torch.sin(x) * 2


class TestBlock(expecttest.TestCase):
    def test_block(self):
        gm = capture_graphs(block, torch.randn(4)).graphs[0]
        self.assertExpectedInline(normalized_graph(gm), """""")
'''


@pytest.mark.slow
def test_inline_form_round_trips_through_expecttest_accept(tmp_path):
    test_file = tmp_path / "test_inline.py"
    test_file.write_text(INLINE_TEST)
    rc, out = _run_pytest(tmp_path, accept=True)
    assert rc == 0, out
    rewritten = test_file.read_text()
    assert normalized_graph(capture_graphs(_sin, torch.randn(4)).graphs[0]) in rewritten
    assert "# File:" not in rewritten
    rc, out = _run_pytest(tmp_path)
    assert rc == 0, out
    assert test_file.read_text() == rewritten
