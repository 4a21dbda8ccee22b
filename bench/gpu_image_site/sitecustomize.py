"""A dry run of a GPU call on this machine: only the GPU image's packages (bench/gpu_image_packages.txt) and what the
run installs itself (the wheel folder, into the folder it puts first on PYTHONPATH) can be imported.

    PYTHONPATH=bench/gpu_image_site bash bench/gpu_check.sh runs/dry --part eager --device cpu --wheels DIR

Python imports a ``sitecustomize`` it finds on the path at start-up, so this holds in every process of the run. A
top-level import that would come from this interpreter's own site-packages, out of a distribution the image does not
hold, raises ModuleNotFoundError as it would on the GPU machine; so does one of the carried wheels'
(bench/gpu_wheels.txt), which must come from the run's own install. Versions are not imitated (this machine's torch
is not the image's 2.11), so what a package of the image needs here (this huggingface_hub's httpx2, say) passes: the
image's own version brings what it needs.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import re
import site
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent
PACKAGES, WHEELS = BENCH / "gpu_image_packages.txt", BENCH / "gpu_wheels.txt"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(path: Path) -> set[str]:
    """The distribution names of a list or requirements file (comments and version pins left out)."""
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {_norm(re.split(r"[=<>!~ ;\[]", line)[0]) for line in lines if line}


def _needed_by(roots: set[str]) -> set[str]:
    """``roots`` and every distribution installed here that they need, transitively (extras left out)."""
    requires = {}
    for dist in importlib.metadata.distributions():
        reqs = [r for r in dist.requires or [] if "extra ==" not in r and "extra==" not in r]
        requires[_norm(dist.metadata["Name"] or "")] = {_norm(re.split(r"[=<>!~ ;(\[]", r)[0]) for r in reqs}
    seen, todo = set(), [r for r in roots if r in requires]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(requires.get(name, set()) - seen)
    return seen | roots


class ImageOnly:
    """A meta-path finder that refuses what the GPU image would not have, and otherwise lets the others find it."""

    def __init__(self, image: set[str], carried: set[str], site_dirs: Sequence[str]) -> None:
        self.image, self.carried, self.site_dirs = image, carried, tuple(site_dirs)
        self.allowed: set[str] | None = None  # the image's distributions and what they need here: at the 1st question
        self.dists: dict[str, list[str]] = {}  # module → distributions

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if "." in fullname or fullname in sys.stdlib_module_names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname)  # where sys.path would find it
        if spec is None:
            return None
        where = spec.origin if spec.origin not in (None, "namespace") else next(
            iter(spec.submodule_search_locations or []), None)
        if where is None or not str(Path(where).resolve()).startswith(self.site_dirs):
            return None  # the repository, or the folder the run installed its wheels into
        if self.allowed is None:
            self.allowed = _needed_by(self.image) - self.carried
            self.dists = importlib.metadata.packages_distributions()
        dists = self.dists.get(fullname, [])
        if any(_norm(d) in self.allowed for d in dists):
            return None
        raise ModuleNotFoundError(f"No module named {fullname!r} (dry run: {', '.join(dists) or 'its distribution'} "
                                  f"is not in the GPU image, {PACKAGES.name}, or comes from the carried wheels)",
                                  name=fullname)


sys.meta_path.insert(0, ImageOnly(_names(PACKAGES), _names(WHEELS),
                                  [str(Path(p).resolve()) for p in site.getsitepackages()]))
