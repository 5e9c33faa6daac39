"""A plain `pip install` of the built wheel, no extras, into a fresh venv runs the demo: the declared runtime
dependencies are complete and the package data (the YAML policies) ships in the wheel.

torch itself is not installed into the fresh venv: the 2.15 wheel is a 5 GB CUDA build, and installing it again per
run would dominate CI. The running torch, and only the distributions torch itself requires, are put on the fresh
venv's path through a `.pth` file; pip sees them as installed and leaves them alone. Nothing else of the test
environment is visible there, so numpy and pyyaml (which torch does not require) must come from the wheel's own
dependencies, installed by pip from the configured index (or its cache).
"""

import importlib.metadata as metadata
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

from packaging.requirements import Requirement

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

ROOT = Path(__file__).resolve().parents[1]


def _distribution_and_requirements(name: str, seen: dict) -> None:
    """`name` and every distribution it requires (markers evaluated, no extras), by normalized name."""
    dist = metadata.distribution(name)
    key = dist.metadata["Name"].lower().replace("_", "-")
    if key in seen:
        return
    seen[key] = dist
    for text in dist.requires or ():
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            _distribution_and_requirements(requirement.name, seen)


def _torch_only_path(target: Path) -> Path:
    """A folder of links to the running torch and what it requires (their importable names and dist-info)."""
    target.mkdir()
    seen: dict = {}
    _distribution_and_requirements("torch", seen)
    for dist in seen.values():
        site = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or ()}:
            source = site / top
            if top not in ("..", "bin", "__pycache__") and source.exists() and not (target / top).exists():
                (target / top).symlink_to(source, target_is_directory=source.is_dir())
    return target


def _build_requirements_met() -> bool:
    """Whether the running environment has what pyproject's [build-system] requires (setuptools>=68), so that the
    wheel can be built without an isolated build environment. torch 2.11/2.12 pin setuptools<82 and a Python 3.11
    venv starts with 65.5, which cannot build a wheel of this project."""
    if tomllib is None:
        return False
    with open(ROOT / "pyproject.toml", "rb") as f:
        requires = tomllib.load(f)["build-system"]["requires"]
    for text in requires:
        requirement = Requirement(text)
        try:
            version = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            return False
        if not requirement.specifier.contains(version, prereleases=True):
            return False
    return True


def _run(args, **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=900, **kwargs)
    assert out.returncode == 0, f"{args}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def test_the_wheel_installed_without_extras_runs_the_demo(tmp_path):
    wheels, source = tmp_path / "wheels", tmp_path / "source"
    # built from a copy: pip builds in the source tree, and CI runs two torches' suites at once from one checkout
    shutil.copytree(ROOT / "dtensor_ext", source / "dtensor_ext", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    # without build isolation where this environment can build it (no download); else pip fetches the build
    # requirements from the configured index (or its cache), as it does the wheel's own dependencies below
    isolation = ["--no-build-isolation"] if _build_requirements_met() else []
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", wheels, source])
    (wheel,) = wheels.glob("dtensor_ext-*.whl")

    fresh, work = tmp_path / "venv", tmp_path / "work"  # work: not the repository, so the wheel is what's imported
    venv.create(fresh, with_pip=True)
    work.mkdir()
    python = fresh / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    (site / "torch.pth").write_text(f"{_torch_only_path(tmp_path / 'torch-only')}\n")
    found = _run([python, "-c", "import importlib.util as u; print([m for m in ('numpy', 'yaml', 'dtensor_ext') "
                                "if u.find_spec(m)], u.find_spec('torch') is not None)"], cwd=work, env=env)
    assert found.stdout.strip() == "[] True"  # torch, and none of the package's own dependencies

    _run([python, "-m", "pip", "install", "-q", wheel], cwd=work, env=env)
    out = _run([python, "-m", "dtensor_ext", "demo", "--steps", "2", "--layers", "1"], cwd=work, env=env)
    assert out.stdout.endswith("OK: matches one device\n") and out.stderr == "", out.stderr[-3000:]
    assert "plan from the YAML policy" in out.stdout and (work / "dtensor_ext_demo.svg").exists()
    where = _run([python, "-c", "import dtensor_ext, numpy, yaml, torch; print(dtensor_ext.__file__, numpy.__file__, "
                                "yaml.__file__, torch.__file__)"], cwd=work, env=env).stdout.split()
    assert all(Path(p).is_relative_to(site) for p in where[:3]), where  # the wheel and its dependencies, in the venv
    assert not Path(where[3]).is_relative_to(site)  # pip left the running torch alone
