"""A wheelhouse for an offline machine that has its own PyTorch (issue #49, item 7): every wheel the project
needs there except torch, resolved against that machine's installed packages, made on any machine that
reaches a package index.

    python tools/wheelhouse.py                            # the GPU node: Python 3.12, manylinux x86-64, -> wheelhouse/
    python tools/wheelhouse.py --python 3.11 --dest DIR   # the same resolution for another Python (the CPU rehearsal)
    python tools/wheelhouse.py --node none                # a machine with nothing but Python and torch
    python tools/wheelhouse.py --extras hf                # with an extra (refused for the node: its transformers is older)
    python tools/wheelhouse.py --python 3.11 --unpin numpy  # a pin with no wheel for that Python, left free

What it does, in order:
1. Reads the project's requirements (pyproject.toml: `dependencies`, the `--extras`, and setuptools ≥ 70.1, the
   build backend, which tests/project/test_console_scripts.py uses to build a wheel offline) and the node's packages
   (`--node`, default tools/gpu_node/requirements-node.txt: `name==version`, `name`, or `name<bound`).
2. Refuses, one line each, every requirement of the project that a version on the node does not meet
   (torch included: the node's torch is used, never replaced). Nothing is downloaded then.
3. `pip wheel`s the packages that ship only as an sdist (SDIST_ONLY; a pure-Python wheel fits every Python)
   and the project itself, then `pip download`s the rest for `--python` and `--platform` with
   `--only-binary=:all:`, the node's pins as constraints (`-c`), torch left out. A conflict between the
   node's versions and the project's pins deeper down (datasets wants pyarrow, fsspec, dill, huggingface-hub
   in ranges) is pip's ResolutionImpossible, reported as such.
4. Removes the wheels the node has at exactly that version, and the large ones (over `--fallback-mb`) of packages
   the node has at a version nobody recorded; small ones stay as fallbacks, which pip installs only where the
   node's version fails a pin. What the removed ones must satisfy goes to DEST/node-needs.txt (run.sh checks it
   on the node before installing), and the whole resolution to DEST/MANIFEST.txt.

On the node: `pip install --no-index --find-links wheelhouse wheelhouse/transformer_wmt-*.whl` in a venv that
sees the node's packages (tools/gpu_node/run.sh does this and checks that torch is the node's). The
wheelhouse is not committed: it travels as an ignored folder (the device tool's `carry`, 64 MiB at most).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib
try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ModuleNotFoundError:  # a bare venv: pip's own copy
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
NODE = ROOT / "tools" / "gpu_node" / "requirements-node.txt"
PROVIDED = "torch"  # the node's own; never downloaded, never replaced
BUILD_BACKEND = "setuptools>=70.1"  # pyproject's [build-system] wants >= 68; 70.1 has bdist_wheel without `wheel`
# Released only as an sdist: built here into a pure-Python wheel. hydra-core 1.3 pins antlr4 4.9.*.
SDIST_ONLY = ["antlr4-python3-runtime==4.9.3"]
CARRY_LIMIT_MB = 64  # the device tool's limit on what travels with the working tree


class WheelhouseError(Exception):
    """A one-line reason to stop."""


@dataclass
class Node:
    """The target machine's installed packages: exact versions where known, else bounds or nothing."""
    pinned: dict[str, Version] = field(default_factory=dict)
    bounded: dict[str, Requirement] = field(default_factory=dict)
    present: set[str] = field(default_factory=set)  # every name on the node, pinned or not

    @classmethod
    def read(cls, path: Path | None) -> "Node":
        node = cls()
        if path is None:
            return node
        for number, raw in enumerate(path.read_text().splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                requirement = Requirement(line)
            except Exception as error:
                raise WheelhouseError(f"{path}:{number}: not a requirement line: {raw!r} ({error})") from None
            name = canonicalize_name(requirement.name)
            node.present.add(name)
            pins = [s for s in requirement.specifier if s.operator in ("==", "===")]
            if pins:
                node.pinned[name] = Version(pins[0].version)
            elif requirement.specifier:
                node.bounded[name] = requirement
        return node


def project_requirements(extras: list[str]) -> list[tuple[Requirement, str]]:
    """(requirement, where it comes from) for the dependencies, the chosen extras and the build backend."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = [(Requirement(r), "dependencies") for r in project["dependencies"]]
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise WheelhouseError(f"no extra {extra!r} in pyproject.toml (it has: {', '.join(sorted(optional))})")
        found += [(Requirement(r), f"the [{extra}] extra") for r in optional[extra]]
    found.append((Requirement(BUILD_BACKEND), "the build backend"))
    return found


def conflicts(requirements: list[tuple[Requirement, str]], node: Node) -> list[str]:
    """The project's direct requirements that a version recorded for the node does not meet."""
    lines = []
    for requirement, where in requirements:
        name = canonicalize_name(requirement.name)
        version = node.pinned.get(name)
        if version is not None and not requirement.specifier.contains(version, prereleases=True):
            lines.append(f"{name} {version} on the node does not meet {requirement} ({where})")
        if name == PROVIDED and name not in node.present and node.present:
            lines.append(f"{name} is not among the node's packages: this wheelhouse never carries it")
    return lines


def platform_options(python: str, platforms: list[str]) -> list[str]:
    digits = python.replace(".", "")
    options = ["--python-version", python, "--implementation", "cp", "--abi", f"cp{digits}", "--only-binary=:all:"]
    for platform in platforms:
        options += ["--platform", platform]
    return options


def manylinux(glibc: str, machine: str) -> list[str]:
    """Every manylinux tag up to `glibc` (pip matches each tag exactly)."""
    major, minor = (int(x) for x in glibc.split("."))
    tags = [f"manylinux_{major}_{n}_{machine}" for n in range(minor, 4, -1)]
    legacy = {"manylinux2014": 17, "manylinux2010": 12, "manylinux1": 5}
    return tags + [f"{name}_{machine}" for name, level in legacy.items() if level <= minor]


def pip(*args: str) -> None:
    command = [sys.executable, "-m", "pip", *args]
    print("+", " ".join(command), flush=True)
    result = subprocess.run(command, text=True, capture_output=True)
    if result.returncode:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-25:])
        why = ("the node's versions (the constraints) conflict with the project's pins"
               if "ResolutionImpossible" in tail or "conflict" in tail.lower() else "pip failed")
        raise WheelhouseError(f"{why}:\n{tail}")


def wheel_requirements(path: Path, environment: dict) -> list[Requirement]:
    """The Requires-Dist of a wheel that apply without extras on the target Python."""
    with zipfile.ZipFile(path) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(metadata).decode("utf-8", "replace")
    found = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            requirement = Requirement(line.split(":", 1)[1].strip())
            if requirement.marker is None or requirement.marker.evaluate({**environment, "extra": ""}):
                found.append(requirement)
    return found


def build(args: argparse.Namespace) -> int:
    node = Node.read(None if args.node == "none" else Path(args.node))
    for name in map(canonicalize_name, args.unpin):  # e.g. numpy 2.5 has no wheel for Python 3.11
        node.pinned.pop(name, None)
        node.bounded.pop(name, None)
    requirements = project_requirements(args.extras)
    problems = conflicts(requirements, node)
    if problems:
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        print("error: nothing downloaded. Update those packages on the node, or build without that extra "
              "(the GPU check needs no extra)", file=sys.stderr)
        return 2

    dest = Path(args.dest).resolve()
    if dest.exists() and any(dest.iterdir()) and not (dest / "MANIFEST.txt").is_file():
        raise WheelhouseError(f"--dest {dest} is a folder that is not a wheelhouse (no MANIFEST.txt), and it would be "
                              "replaced: give a new folder, or an earlier wheelhouse")
    if dest.exists():
        shutil.rmtree(dest)  # an earlier wheelhouse, or an empty folder
    dest.mkdir(parents=True)
    environment = {**default_environment(), "python_version": args.python,
                   "python_full_version": f"{args.python}.0", "implementation_name": "cpython",
                   "platform_python_implementation": "CPython", "sys_platform": "linux",
                   "platform_system": "Linux", "platform_machine": args.machine, "os_name": "posix"}

    with tempfile.TemporaryDirectory() as scratch:
        constraints = Path(scratch) / "constraints.txt"
        constraints.write_text("".join(f"{n}=={v}\n" for n, v in node.pinned.items() if n != PROVIDED)
                               + "".join(f"{r}\n" for r in node.bounded.values()))
        for spec in SDIST_ONLY:
            pip("wheel", "--no-deps", "--no-binary", ":all:", "-w", str(dest), spec)
        pip("wheel", "--no-deps", "-w", str(dest), str(ROOT))
        wanted = [str(r) for r, _ in requirements if canonicalize_name(r.name) != PROVIDED]
        pip("download", "-d", str(dest), "--find-links", str(dest), "-c", str(constraints),
            *platform_options(args.python, args.platform or manylinux(args.glibc, args.machine)), *wanted)

    wheels = sorted(dest.glob("*.whl"))
    if sorted(dest.iterdir()) != wheels:
        raise WheelhouseError(f"{dest} holds files that are not wheels: {sorted(dest.iterdir())}")
    resolved = {canonicalize_name(parse_wheel_filename(w.name)[0]): w for w in wheels}
    if PROVIDED in resolved:
        raise WheelhouseError(f"a dependency pulled in {resolved[PROVIDED].name}: the node's own torch must do")

    needs: dict[str, list[tuple[str, str]]] = {}  # name -> [(specifier, the wheel that asks)]
    for owner, path in resolved.items():
        for requirement in wheel_requirements(path, environment):
            needs.setdefault(canonicalize_name(requirement.name), []).append((str(requirement.specifier), owner))
    manifest, carried, assumed = [], [], []
    for name, path in resolved.items():
        version = parse_wheel_filename(path.name)[1]
        size = path.stat().st_size / 2**20
        asked = "; ".join(f"{owner} {spec or '(any)'}" for spec, owner in needs.get(name, [])) or "the project"
        keep = True
        if node.pinned.get(name) == version:
            fate, keep = "on the node at this version: left out", False
        elif name in node.present and size > args.fallback_mb:
            fate, keep = f"on the node, version not recorded: left out ({size:.1f} MiB); wanted by {asked}", False
        elif name in node.present:
            fate = f"on the node, version not recorded: carried as a fallback ({size:.2f} MiB)"
        else:
            fate = f"carried ({size:.2f} MiB)"
        if keep:
            carried.append(path)
        else:
            path.unlink()
            bounds = ",".join(spec for spec, _ in needs.get(name, []) if spec)
            assumed.append(f"{name}{bounds}  # wanted by {asked}; resolved here at {version}")
        manifest.append(f"{name}=={version}  # {fate}")

    total = sum(p.stat().st_size for p in carried) / 2**20
    header = [f"# tools/wheelhouse.py --python {args.python} --node {args.node} "
              + "".join(f"--unpin {n} " for n in args.unpin)
              + f"--extras {','.join(args.extras) or '(none)'}: {len(carried)} wheels, {total:.1f} MiB carried",
              "# torch: the node's own, never in here"]
    (dest / "MANIFEST.txt").write_text("\n".join(header + manifest) + "\n")
    (dest / "node-needs.txt").write_text(
        "# what this wheelhouse leaves to the node (torch aside), and what the others need of it\n"
        + "".join(f"{line}\n" for line in sorted(assumed)))
    print("\n".join(header + manifest))
    print(f"wheelhouse: {dest} ({len(carried)} wheels, {total:.1f} MiB)")
    if total > CARRY_LIMIT_MB - 8:
        print(f"warning: {total:.1f} MiB leaves little of the device tool's {CARRY_LIMIT_MB} MiB for the checkout",
              file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default="3.12", help="the target's Python, major.minor (default: the node's 3.12)")
    parser.add_argument("--machine", default="x86_64")
    parser.add_argument("--glibc", default="2.28",
                        help="newest manylinux tag taken (default 2.28: the node runs torch 2.11's manylinux_2_28 wheel)")
    parser.add_argument("--platform", action="append", help="pip platform tags instead of --glibc's manylinux list")
    parser.add_argument("--node", default=str(NODE),
                        help="the target's packages, one requirement a line (default: the GPU node's); 'none': a bare Python")
    parser.add_argument("--unpin", action="append", default=[], metavar="NAME",
                        help="treat the node's NAME as of an unrecorded version (a rehearsal on another Python)")
    parser.add_argument("--extras", type=lambda s: [e for e in s.split(",") if e], default=[],
                        help="comma-separated extras of pyproject.toml (default: none)")
    parser.add_argument("--fallback-mb", type=float, default=2.0,
                        help="keep wheels of node packages whose version is not recorded up to this size")
    parser.add_argument("--dest", default=str(ROOT / "wheelhouse"))
    args = parser.parse_args(argv)
    try:
        return build(args)
    except OSError as error:  # e.g. a --node file that does not exist
        print(f"error: {error.filename or ''}: {error.strerror or error}", file=sys.stderr)
        return 2
    except WheelhouseError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
