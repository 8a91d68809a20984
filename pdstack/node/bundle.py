"""The node bundle: what a node applies to itself and what it runs it with, one reproducible tar.gz per environment
and release, published by sha256 (pdstack/node/publish.py) and unpacked by stage 0 (pdstack/node/loader.py).

It holds, at the paths loader.py and apply.py read:
- `ansible.cfg`, `plugins/` (the strategy ansible.cfg names), `roles/` and `playbooks/` (node.yml and the files it
  loads: vars/serving.yml, vars/node.yml and the environment's rendered vars/contract/<env>.yml and
  vars/vllm/<env>.yml; no other environment's);
- `inventories/aws/group_vars/all/stacks.yml`: the cloud environments' facts node.yml maps as inventories/aws does;
- `collections/ansible_collections/<namespace>/<name>/` (apply.COLLECTIONS_DIR): the collections the roles and
  node.yml use, copied from the installed `ansible` package without their tests (the node's venv has ansible-core);
- `wheels/`: pdstack and pdserve built as wheels, their runtime dependencies and ansible-core, mitogen, boto3 and
  botocore at the pins of the pyproject files (pip download for Debian 12's CPython 3.11 on x86_64, binary wheels
  only), and `wheels/requirements.txt` (loader.REQUIREMENTS), what stage 0 installs of them offline.

Reproducible: members sorted, plain files only, owner 0:0, mtime SOURCE_DATE_EPOCH (0), modes 0644 or 0755, gzip
without a name or a time; the two wheels built here take SOURCE_DATE_EPOCH too. The same tree gives the same sha256.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement

from pdstack.contract.files import CONTRACT_VARS_DIR
from pdstack.node.apply import ANSIBLE_CFG, COLLECTIONS_DIR, PLUGINS_DIR, ROLES_DIR
from pdstack.node.loader import REQUIREMENTS, WHEELS
from pdstack.vllm.deploy import VARS_DIR as VLLM_VARS_DIR

PLAYBOOK = "playbooks/node.yml"
# The collections the roles (containers.podman, community.general, ansible.posix) and node.yml (amazon.aws: the
# scheduler URL's SSM lookup) use; a test checks every collection named under roles/ and playbooks/ is here.
COLLECTIONS = ("amazon.aws", "ansible.posix", "community.general", "containers.podman")
# The environment's facts node.yml loads (rendered by pdstack.contract.cloud_inventory)
CLOUD_FACTS = "inventories/aws/group_vars/all/stacks.yml"
# one file per environment, <env>.yml: the rendered contract and vLLM values
ENV_VARS_DIRS = (CONTRACT_VARS_DIR.as_posix(), VLLM_VARS_DIR.as_posix())
PLATFORM_DIR = "playbooks/vars/platform"  # the local platform's local.yml, and cloud.yml for every other
SKIP = {"__pycache__", ".pytest_cache", "tests", ".git"}
SOURCE_DATE_EPOCH = 0  # the members' mtime
WHEEL_EPOCH = 315532800  # 1980-01-01, the earliest time a zip (a wheel) stores
# The node: Debian 12's CPython 3.11 on x86_64 (glibc 2.36)
NODE_PYTHON = "3.11"
NODE_PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "manylinux_2_34_x86_64")
ANSIBLE_EXTRA = "ansible"  # pyproject's extra holding ansible-core and boto3 (and the `ansible` package, not taken)
NOT_ON_NODES = {"ansible"}  # the whole `ansible` package: the node takes its few collections instead
# The projects built as wheels: (folder in the checkout, its packages, its other files beside pyproject.toml)
WHEEL_PROJECTS = ((".", ("pdstack", "infra"), ("README.md",)), ("serving", ("pdserve",), ("README.md",)))

Run = Callable[..., subprocess.CompletedProcess[str]]


class BundleError(RuntimeError):
    pass


@dataclass(frozen=True)
class Bundle:
    path: Path
    sha256: str
    size: int
    members: tuple[str, ...]


def _files_under(root: Path, prefix: str) -> dict[str, Path]:
    """Archive name -> file, for every regular file under root (symlinks followed only to files; skipping SKIP)."""
    found: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP)
        for name in filenames:
            path = Path(dirpath, name)
            if path.suffix == ".pyc" or not path.is_file():
                continue
            found[f"{prefix}/{path.relative_to(root).as_posix()}"] = path
    return found


def installed_collections() -> Path:
    """The ansible_collections folder of the installed `ansible` package."""
    spec = importlib.util.find_spec("ansible_collections")
    if spec is None or not spec.submodule_search_locations:
        raise BundleError("the `ansible` package is not installed here: its collections go into the node bundle")
    return Path(next(iter(spec.submodule_search_locations)))


def tree_files(repo: Path, env: str, collections_from: Path) -> dict[str, Path]:
    """Every file of the bundle but the wheels: archive name -> source file."""
    files = {ANSIBLE_CFG: repo / ANSIBLE_CFG, CLOUD_FACTS: repo / CLOUD_FACTS}
    files.update(_files_under(repo / ROLES_DIR, ROLES_DIR))
    files.update(_files_under(repo / PLUGINS_DIR, PLUGINS_DIR))
    playbooks = _files_under(repo / "playbooks", "playbooks")
    for name in list(playbooks):
        folder, _, file = name.rpartition("/")
        if folder in ENV_VARS_DIRS and file != f"{env}.yml":
            del playbooks[name]  # another environment's rendered values
        elif folder == PLATFORM_DIR and file not in (f"{env}.yml", "cloud.yml"):
            del playbooks[name]
    for folder in ENV_VARS_DIRS:
        if f"{folder}/{env}.yml" not in playbooks:
            raise BundleError(f"no {folder}/{env}.yml: render the environment first (docs/node-bootstrap.md)")
    files.update(playbooks)
    for collection in COLLECTIONS:
        namespace, name = collection.split(".")
        source = collections_from / namespace / name
        if not (source / "MANIFEST.json").is_file() and not (source / "galaxy.yml").is_file():
            raise BundleError(f"collection {collection} is not in {collections_from}")
        files.update(_files_under(source, f"{COLLECTIONS_DIR}/ansible_collections/{namespace}/{name}"))
    missing = [name for name, path in files.items() if not path.is_file()]
    if missing:
        raise BundleError(f"missing from {repo}: {', '.join(missing)}")
    return files


# -- wheels ------------------------------------------------------------------------------------------------------
def bundle_sources(repo: Path) -> list[Path]:
    """Every file or folder of the checkout a bundle is built from (the collections come from the installed
    `ansible` package, at the pyproject's pin): what a cache of bundles keys on."""
    tree = [repo / ANSIBLE_CFG, repo / CLOUD_FACTS, repo / ROLES_DIR, repo / PLUGINS_DIR, repo / "playbooks"]
    wheels = [
        repo / folder / name
        for folder, packages, extra in WHEEL_PROJECTS
        for name in ("pyproject.toml", *packages, *extra)
    ]
    return tree + wheels


def _project(pyproject: Path) -> dict[str, object]:
    return dict(tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"])


def _pins(requirements: Iterable[str]) -> list[str]:
    """Each requirement without its environment marker: the bundle carries a wheel for any node Python 3.11 (e.g.
    async-timeout, which pdserve needs below 3.11.3: Debian 12 has 3.11.2)."""
    out = []
    for text in requirements:
        req = Requirement(text)
        if req.name not in NOT_ON_NODES:
            req.marker = None
            out.append(str(req))
    return out


def node_requirements(repo: Path) -> tuple[list[str], list[str]]:
    """(what stage 0 installs: pdstack, pdserve and the `ansible` extra but the `ansible` package (ansible-core,
    mitogen, boto3, botocore), pinned; what is downloaded: every runtime dependency of pdstack and pdserve and
    those, at the pyproject files' pins)."""
    pdstack, pdserve = _project(repo / "pyproject.toml"), _project(repo / "serving" / "pyproject.toml")
    extra = dict(pdstack.get("optional-dependencies", {}))  # type: ignore[call-overload]
    ansible = _pins(list(extra[ANSIBLE_EXTRA]))
    install = [f"{pdstack['name']}=={pdstack['version']}", f"{pdserve['name']}=={pdserve['version']}", *ansible]
    download = [*_pins(list(pdstack["dependencies"])), *_pins(list(pdserve["dependencies"])), *ansible]  # type: ignore[call-overload]
    return install, download


def _copy_project(source: Path, target: Path, packages: Sequence[str], extra_files: Sequence[str]) -> Path:
    """A clean copy of a project's sources to build a wheel from (no egg-info or build/ of the working tree)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    target.mkdir(parents=True)
    for name in ["pyproject.toml", *extra_files]:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
    for package in packages:
        shutil.copytree(source / package, target / package, ignore=ignore)
    return target


def wheel_commands(python: str, sources: Sequence[Path], download: Path, wheel_dir: Path) -> list[list[str]]:
    """pip's two steps: pdstack and pdserve as wheels (their own code, built here without build isolation, so from
    the setuptools already installed), then every pinned dependency as the node's binary wheels."""
    platforms = [word for platform in NODE_PLATFORMS for word in ("--platform", platform)]
    into = ["--dest", str(wheel_dir), "--requirement", str(download)]
    node = ["--implementation", "cp", "--python-version", NODE_PYTHON, "--abi", f"cp{NODE_PYTHON.replace('.', '')}"]
    return [
        [python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(wheel_dir)]
        + [str(s) for s in sources],
        [python, "-m", "pip", "download", "--only-binary=:all:", *node, *platforms, *into],
    ]


def build_wheels(repo: Path, work: Path, python: str = sys.executable, run: Run = subprocess.run) -> dict[str, Path]:
    """wheels/ of the bundle: archive name -> file."""
    install, download = node_requirements(repo)
    sources = [
        _copy_project(repo / folder, work / "src" / packages[0], packages, extra)
        for folder, packages, extra in WHEEL_PROJECTS
    ]
    wheel_dir = work / WHEELS
    wheel_dir.mkdir()
    (work / REQUIREMENTS).write_text("\n".join(install) + "\n", encoding="utf-8")
    requirements = work / "download.txt"
    requirements.write_text("\n".join(download) + "\n", encoding="utf-8")
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(WHEEL_EPOCH)}
    for argv in wheel_commands(python, sources, requirements, wheel_dir):
        answer = run(argv, capture_output=True, text=True, check=False, env=env, cwd=work)
        if answer.returncode != 0:
            raise BundleError(f"{' '.join(argv[:4])} failed:\n{answer.stdout[-2000:]}{answer.stderr[-3000:]}")
    return {f"{WHEELS}/{p.name}": p for p in sorted(wheel_dir.iterdir()) if p.is_file()}


# -- the archive -------------------------------------------------------------------------------------------------
def write_archive(files: dict[str, Path], out: Path) -> str:
    """A reproducible tar.gz of `files` (archive name -> source) at `out`; its sha256."""
    raw = out.with_name(f".{out.name}.partial")
    with (
        raw.open("wb") as sink,
        gzip.GzipFile(filename="", mode="wb", fileobj=sink, mtime=0, compresslevel=6) as zipped,
        tarfile.open(fileobj=zipped, mode="w", format=tarfile.GNU_FORMAT) as tar,
    ):
        for name in sorted(files):
            source = files[name]
            info = tarfile.TarInfo(name)
            info.size = source.stat().st_size
            info.mtime = SOURCE_DATE_EPOCH
            info.mode = 0o755 if os.access(source, os.X_OK) and not name.startswith(f"{WHEELS}/") else 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with source.open("rb") as data:
                tar.addfile(info, data)
    os.replace(raw, out)
    digest = hashlib.sha256()
    with out.open("rb") as data:
        while block := data.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def bundle_name(env: str) -> str:
    return f"pdstack-node-{env}.tar.gz"


def build_bundle(
    repo: Path,
    env: str,
    out_dir: Path,
    *,
    wheels: bool = True,
    collections_from: Path | None = None,
    python: str = sys.executable,
    run: Run = subprocess.run,
    rendered: Mapping[str, str] | None = None,
) -> Bundle:
    """The environment's node bundle in out_dir; `wheels=False` leaves wheels/ out (a bundle no node can install,
    for looking at the rest quickly). `rendered`: the text of some of the environment's rendered values in place of
    the checkout's files (archive name -> text; ENV_VARS_DIRS' files only), as the local environment's engine choice
    renders them."""
    files = tree_files(repo, env, collections_from or installed_collections())
    unknown = sorted(set(rendered or {}) - {f"{folder}/{env}.yml" for folder in ENV_VARS_DIRS})
    if unknown:
        raise BundleError(f"only the environment's rendered values may be replaced, not {', '.join(unknown)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / bundle_name(env)
    with tempfile.TemporaryDirectory(prefix="pdstack-bundle-") as work:
        for name, text in (rendered or {}).items():
            files[name] = Path(work) / "rendered" / name
            files[name].parent.mkdir(parents=True, exist_ok=True)
            files[name].write_text(text, encoding="utf-8")
        if wheels:
            files.update(build_wheels(repo, Path(work), python, run))
        sha256 = write_archive(files, out)
    return Bundle(out, sha256, out.stat().st_size, tuple(sorted(files)))


def members(archive: Path) -> list[str]:
    with tarfile.open(archive) as tar:
        return tar.getnames()


def read_member(archive: Path, name: str) -> bytes:
    with tarfile.open(archive) as tar:
        member = tar.extractfile(name)
        if member is None:
            raise KeyError(name)
        return member.read()
