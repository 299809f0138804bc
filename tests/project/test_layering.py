"""Which way imports go (docs/DESIGN.md's picture): every module's imports, read with `ast`, held to the rules.

- data/ is the lower layer: it imports nothing from transformer/.
- Only transformer/cli.py imports Hydra; only the entry scripts import transformer.cli; no entry script
  imports another.
- OmegaConf only where a config is composed or written as YAML: the CLI, training.py, run_record.py,
  table3.py and the entry scripts. The library (config, model, search, the Translator) loads neither Hydra, OmegaConf nor
  `datasets`, which a fresh interpreter confirms.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENTRY_SCRIPTS = ("train.py", "translate.py", "evaluate.py")
OMEGACONF_ALLOWED = {*ENTRY_SCRIPTS, "transformer/cli.py", "transformer/training.py", "transformer/run_record.py",
                     "transformer/table3.py"}


def imports_of(path: Path) -> set[str]:
    """Every absolute module a file imports, at any depth (lazy imports inside functions count too);
    `from package import module` counts as `package.module` as well."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def modules() -> dict[str, set[str]]:
    files = [*(ROOT / name for name in ENTRY_SCRIPTS), *sorted((ROOT / "transformer").glob("*.py")),
             *sorted((ROOT / "data").glob("*.py"))]
    return {str(path.relative_to(ROOT)): imports_of(path) for path in files}


def offenders(rule, table: dict[str, set[str]]) -> list[str]:
    """`file: module` for every import the rule refuses (rule(file, module) is True when allowed)."""
    return sorted(f"{name}: {module}" for name, found in table.items() for module in found if not rule(name, module))


def top(module: str) -> str:
    return module.split(".")[0]


def data_imports_no_transformer(name: str, module: str) -> bool:
    return not (name.startswith("data/") and top(module) == "transformer")


def only_cli_imports_hydra(name: str, module: str) -> bool:
    return top(module) != "hydra" or name == "transformer/cli.py"


def only_entry_scripts_import_cli(name: str, module: str) -> bool:
    return module != "transformer.cli" or name in ENTRY_SCRIPTS


def omegaconf_where_configs_are_composed(name: str, module: str) -> bool:
    return top(module) != "omegaconf" or name in OMEGACONF_ALLOWED


def entry_scripts_stand_alone(name: str, module: str) -> bool:
    return not (name in ENTRY_SCRIPTS and f"{module}.py" in ENTRY_SCRIPTS)


RULES = [data_imports_no_transformer, only_cli_imports_hydra, only_entry_scripts_import_cli,
         omegaconf_where_configs_are_composed, entry_scripts_stand_alone]


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.__name__)
def test_imports_follow_the_layers(rule):
    assert offenders(rule, modules()) == []


def test_the_rules_catch_a_forbidden_import(tmp_path):
    """Each rule refuses the import it is written against (the check is not vacuous)."""
    forbidden = {
        data_imports_no_transformer: ("data/vocab.py", "from transformer.checkpoint import save"),
        only_cli_imports_hydra: ("transformer/model.py", "def f():\n    import hydra"),
        only_entry_scripts_import_cli: ("transformer/translation.py", "from transformer.cli import to_job"),
        omegaconf_where_configs_are_composed: ("transformer/config.py", "from omegaconf import OmegaConf"),
        entry_scripts_stand_alone: ("evaluate.py", "import translate"),
    }
    assert set(forbidden) == set(RULES)
    for rule, (name, source) in forbidden.items():
        path = tmp_path / "module.py"
        path.write_text(source)
        assert offenders(rule, {name: imports_of(path)}), rule.__name__


def test_the_library_loads_no_hydra_omegaconf_or_datasets():
    code = ("import sys\n"
            "from transformer import Translator\n"
            "import transformer.model, transformer.search, transformer.config\n"
            "Translator\n"
            "print(sorted(m for m in ('hydra', 'omegaconf', 'datasets') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
