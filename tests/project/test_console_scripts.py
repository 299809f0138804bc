"""The console scripts `transformer-train`, `transformer-translate`, `transformer-evaluate` of an installed
copy (a wheel built from this checkout), run from another directory. The model is `tiny_run`.
"""

from __future__ import annotations

import shutil
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from helpers import subprocess_env, tiny_run_sources, translate_py  # noqa: E402


# ------------------------------------------------------------------------------- installed console scripts


@pytest.mark.slow
@pytest.mark.extras("setuptools>=70.1")  # the wheel is built offline, with the environment's setuptools
def test_console_scripts_of_an_installed_copy_work_from_any_directory(tiny_run, tmp_path, capsys, monkeypatch):
    """`pip install` (not editable) into a folder, then each console script run from an empty directory
    elsewhere: the configs and entry scripts come from the installed copy, not from this checkout."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "train.py", "translate.py", "evaluate.py"):
        shutil.copy(ROOT / name, source / name)
    for name in ("transformer", "data", "quickstart", "configs"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                              "--no-build-isolation", "--target", str(site), str(source)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr
    shutil.rmtree(source)  # nothing may come from the copy that was installed
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = subprocess_env(buffered=True, PYTHONPATH=str(site))

    def script(name: str, *args: str, stdin: str = "") -> str:
        result = subprocess.run([str(site / "bin" / name), *args], input=stdin, capture_output=True, text=True,
                                cwd=elsewhere, env=env, timeout=600)
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert "interactive" in script("transformer-translate", "--help")
    assert "hyp: null" in script("transformer-evaluate", "--help")
    assert "run_dir: runs/quickstart" in script("transformer-train", "experiment=quickstart", "--cfg", "job")
    lines = tiny_run_sources(tiny_run, 5)
    out = script("transformer-translate", f"checkpoint={tiny_run.run_dir}", "device=cpu", "quiet=true",
                 stdin="".join(line + "\n" for line in lines))
    assert out.splitlines() == translate_py([f"checkpoint={tiny_run.run_dir}"], lines, capsys, monkeypatch)
    assert list(elsewhere.iterdir()) == []


def test_a_users_own_data_module_that_shadows_ours_is_named_in_one_line(tmp_path):
    """The wheel installs a top-level package `data` (the design's layout); a user's `data` module earlier on
    sys.path is reported at `import transformer`, naming both, instead of failing later far from the cause."""
    (tmp_path / "data.py").write_text("rows = []\n")
    result = subprocess.run([sys.executable, "-c", "import transformer"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, env=subprocess_env(PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}"))
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert f"another module named 'data' ({tmp_path / 'data.py'}) shadows this framework's data package" in last
    assert str(ROOT / "data") in last
