"""tools/wheelhouse.py's decisions that need no index: the node's recorded versions against the project's
pins (the build stops before any download), and the manylinux tags it asks pip for. The download itself is
rehearsed by tools/gpu_node/rehearse.sh (README, "On an offline GPU node")."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import wheelhouse  # noqa: E402


def test_the_recorded_node_meets_the_project_without_extras():
    node = wheelhouse.Node.read(wheelhouse.NODE)
    assert node.pinned["torch"].base_version == "2.11.0" and "pyarrow" in node.present
    assert wheelhouse.conflicts(wheelhouse.project_requirements([]), node) == []


def test_a_node_version_below_a_pin_is_refused_before_any_download(tmp_path, capsys):
    """The node's transformers 5.17 is below the [hf] extra's 5.24: one line, exit 2, nothing written."""
    dest = tmp_path / "wheelhouse"
    assert wheelhouse.main(["--extras", "hf", "--dest", str(dest)]) == 2
    err = capsys.readouterr().err
    assert "transformers 5.17.0 on the node does not meet transformers>=5.24 (the [hf] extra)" in err
    assert not dest.exists()


def test_a_dest_that_is_not_a_wheelhouse_is_left_alone_and_a_missing_node_file_is_one_line(tmp_path, capsys):
    """--dest replaces an earlier wheelhouse (its MANIFEST.txt says so), never another folder (the checkout,
    ~/wheels): refused before any download, its files kept; a --node file that is missing is one line, exit 2."""
    (tmp_path / "notes.txt").write_text("mine")
    assert wheelhouse.main(["--dest", str(tmp_path)]) == 2
    assert "is a folder that is not a wheelhouse (no MANIFEST.txt)" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert wheelhouse.main(["--node", str(tmp_path / "missing.txt"), "--dest", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "missing.txt" in err and err.count("\n") == 1 and "Traceback" not in err


def test_an_older_torch_on_the_node_is_refused(tmp_path):
    node_file = tmp_path / "node.txt"
    node_file.write_text("torch==2.2.0\nnumpy==2.5.2\n")
    problems = wheelhouse.conflicts(wheelhouse.project_requirements([]), wheelhouse.Node.read(node_file))
    assert len(problems) == 1 and problems[0].startswith("torch 2.2.0 on the node does not meet torch")


def test_manylinux_tags_run_from_the_glibc_down_to_the_legacy_names():
    tags = wheelhouse.manylinux("2.28", "x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags
    assert tags[-3:] == ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
