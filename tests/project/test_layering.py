"""Which way imports go (docs/DESIGN.md's table): every module's imports, read with `ast` at any depth (lazy
imports inside functions count), held to the layers and searched for circles.

- The layers, lowest first: data/ (and quickstart/ beside it, which imports only data/) → the core
  (transformer/*.py: config, model, kernels, checkpoint, search, loss, distributed) → decoding/ → evaluation/
  → training/ → the faces (transformer/cli.py, console.py, hf.py and the entry scripts). A module imports its
  own layer or a lower one, never a higher one. interop/ stands beside the capabilities: it imports data/ and
  the core only, and only the faces import it.
- No import circle anywhere, found by a depth-first search over the same graph.
- Only transformer/cli.py imports Hydra; only the entry scripts import transformer.cli; no entry script
  imports another. OmegaConf only where a config is composed or written as YAML: the CLI, training/start.py,
  training/run_record.py, evaluation/table3.py and the entry scripts. The library (config, model, search,
  the Translator) loads neither Hydra, OmegaConf nor `datasets`, which a fresh interpreter confirms.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENTRY_SCRIPTS = ("train.py", "translate.py", "evaluate.py")
FACES = {*ENTRY_SCRIPTS, "transformer/cli.py", "transformer/console.py", "transformer/hf.py", "transformer/__init__.py"}
OMEGACONF_ALLOWED = {*ENTRY_SCRIPTS, "transformer/cli.py", "transformer/training/start.py",
                     "transformer/training/run_record.py", "transformer/evaluation/table3.py"}
LAYERS = {"data": 0, "quickstart": 1, "core": 2, "interop": 3, "decoding": 3, "evaluation": 4, "training": 5,
          "face": 6}


def layer(name: str) -> str:
    """The layer of a file, by its path from the root."""
    if name in FACES:
        return "face"
    parts = name.split("/")
    if parts[0] in ("data", "quickstart"):
        return parts[0]
    return parts[1] if len(parts) > 2 else "core"


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


def files() -> list[str]:
    paths = [*(ROOT / name for name in ENTRY_SCRIPTS), *sorted((ROOT / "transformer").rglob("*.py")),
             *sorted((ROOT / "data").rglob("*.py")), *sorted((ROOT / "quickstart").rglob("*.py"))]
    return [str(path.relative_to(ROOT)) for path in paths
            if not {"scripts", "configs"} & set(path.relative_to(ROOT).parts[1:-1])]


def modules() -> dict[str, set[str]]:
    return {name: imports_of(ROOT / name) for name in files()}


def module_file(module: str, names: set[str]) -> str | None:
    """The file of ours that `module` names (a module, or a package's __init__), if any."""
    path = module.replace(".", "/")
    for candidate in (f"{path}.py", f"{path}/__init__.py"):
        if candidate in names:
            return candidate
    return None


def graph(table: dict[str, set[str]]) -> dict[str, set[str]]:
    """file -> the files of ours it imports. `from package import module` is an edge to the module, not to
    the package's __init__ (importing a submodule runs the __init__ first, but the __init__ does not import it)."""
    names = set(table)
    edges = {}
    for name, found in table.items():
        targets = {module_file(module, names) for module in found}
        # `from transformer.training import finetune` adds both "transformer.training" and its ".finetune":
        # the package itself counts only when no submodule of it was named.
        packages = {t for t in targets if t and t.endswith("__init__.py")}
        named = {t for t in targets if t and not t.endswith("__init__.py")}
        packages = {p for p in packages if not any(n.startswith(p.removesuffix("__init__.py")) for n in named)}
        edges[name] = (named | packages) - {name, None}
    return edges


def upward(table: dict[str, set[str]]) -> list[str]:
    """`file -> file` for every import that runs back up a layer, or into interop/ from outside the faces."""
    bad = []
    for name, targets in graph(table).items():
        for target in targets:
            mine, theirs = layer(name), layer(target)
            if theirs == "interop" and mine not in ("interop", "face"):
                bad.append(f"{name} -> {target} (only the faces import interop/)")
            elif mine == "interop" and theirs not in ("interop", "core", "data"):
                bad.append(f"{name} -> {target} (interop/ imports data/ and the core only)")
            elif LAYERS[theirs] > LAYERS[mine]:
                bad.append(f"{name} -> {target} ({mine} imports {theirs}, a higher layer)")
    return sorted(bad)


def circles(table: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle a depth-first search meets, each as the files around it."""
    edges, state, stack, found = graph(table), {}, [], []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == "open":
                found.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return found


def test_no_import_runs_back_up_a_layer():
    assert upward(modules()) == []


def test_no_import_circle():
    assert circles(modules()) == []


def test_every_file_has_a_layer():
    assert {name: layer(name) for name in files() if layer(name) not in LAYERS} == {}


def test_the_layering_catches_a_planted_upward_import_and_a_planted_circle():
    """The checks are not vacuous: the real graph with one import added fails them."""
    table = modules()
    for name, module in [("transformer/model.py", "transformer.training.run"),
                         ("transformer/decoding/translation.py", "transformer.evaluation.scoring"),
                         ("transformer/evaluation/sweep.py", "transformer.training.budget"),
                         ("transformer/interop/marian.py", "transformer.decoding.translation"),
                         ("transformer/training/finetune.py", "transformer.interop.marian"),
                         ("data/vocab.py", "transformer.checkpoint"),
                         ("data/batching.py", "quickstart.corpus")]:
        planted = {**table, name: table[name] | {module}}
        assert upward(planted), (name, module)
    # a circle within one layer: search -> kernels is real, kernels -> search planted
    planted = {**table, "transformer/kernels.py": table["transformer/kernels.py"] | {"transformer.search"}}
    assert upward(planted) == [] and circles(planted)
    planted = {**table, "transformer/training/budget.py": table["transformer/training/budget.py"]
               | {"transformer.training.update"}}  # a lazy one counts the same: imports_of reads every depth
    assert circles(planted)


def offenders(rule, table: dict[str, set[str]]) -> list[str]:
    """`file: module` for every import the rule refuses (rule(file, module) is True when allowed)."""
    return sorted(f"{name}: {module}" for name, found in table.items() for module in found if not rule(name, module))


def top(module: str) -> str:
    return module.split(".")[0]


def only_cli_imports_hydra(name: str, module: str) -> bool:
    return top(module) != "hydra" or name == "transformer/cli.py"


def only_entry_scripts_import_cli(name: str, module: str) -> bool:
    return module != "transformer.cli" or name in ENTRY_SCRIPTS


def omegaconf_where_configs_are_composed(name: str, module: str) -> bool:
    return top(module) != "omegaconf" or name in OMEGACONF_ALLOWED


def entry_scripts_stand_alone(name: str, module: str) -> bool:
    return not (name in ENTRY_SCRIPTS and f"{module}.py" in ENTRY_SCRIPTS)


RULES = [only_cli_imports_hydra, only_entry_scripts_import_cli, omegaconf_where_configs_are_composed,
         entry_scripts_stand_alone]


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.__name__)
def test_imports_follow_the_rules(rule):
    assert offenders(rule, modules()) == []


def test_the_rules_catch_a_forbidden_import(tmp_path):
    """Each rule refuses the import it is written against (the check is not vacuous)."""
    forbidden = {
        only_cli_imports_hydra: ("transformer/model.py", "def f():\n    import hydra"),
        only_entry_scripts_import_cli: ("transformer/decoding/translation.py", "from transformer.cli import to_job"),
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


def test_the_entry_points_start_without_the_plotting_tokenising_corpus_and_event_packages():
    """matplotlib (the report's figures) and sacremoses (tokenised BLEU) cost about 1.7 s of every start of
    train.py, translate.py and evaluate.py; `datasets` (with pandas and pyarrow) about 1.2 s and TensorBoard's
    writer 0.4 s of every start of train.py. Each is imported where a figure is drawn, such a BLEU scored, a
    corpus read or an event written, so that a command that does none of it (--help, --cfg job, a user error)
    does not wait for them."""
    code = ("import sys\n"
            "import train, translate, evaluate\n"
            "print(sorted(m for m in ('matplotlib', 'sacremoses', 'datasets', 'pandas', 'pyarrow', 'tensorboard',\n"
            "                         'torch.utils.tensorboard') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
