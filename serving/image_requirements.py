"""Requirements the runtime image's Python needs that the host's does not (printed one per line, pinned).

The wheelhouse is built on the host (DESIGN.md: pip inside a container fails the TLS proxy's checks), so pip resolves
environment markers for the host's interpreter. The image runs Debian 12's python3 (3.11.2 today), and a marker such
as redis's `async-timeout; python_full_version < '3.11.3'` is false on a newer host but true in the image: the image
install would then fail for want of that wheel. This walks pdserve's installed dependency closure and prints each
requirement whose marker holds for the image's version and not for the host's, for build-image.sh to add to the
wheelhouse (pdserve's own pyproject pins such a requirement for the image's version, e.g. async-timeout).

Usage: python serving/image_requirements.py PYTHON_FULL_VERSION   (e.g. 3.11.2)
"""

from __future__ import annotations

import importlib.metadata
import sys

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def closure(root: str) -> set[str]:
    """Distribution names pdserve pulls in on this host (extras not followed)."""
    seen: set[str] = set()
    todo = [root]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for raw in importlib.metadata.requires(name) or []:
            requirement = Requirement(raw)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def image_only(root: str, target_version: str) -> list[Requirement]:
    target = {
        **default_environment(),
        "python_full_version": target_version,
        "python_version": ".".join(target_version.split(".")[:2]),
        "extra": "",
    }
    host = {**default_environment(), "extra": ""}
    extra: list[Requirement] = []
    for name in sorted(closure(root)):
        for raw in importlib.metadata.requires(name) or []:
            requirement = Requirement(raw)
            marker = requirement.marker
            if marker is not None and marker.evaluate(target) and not marker.evaluate(host):
                requirement.marker = None
                extra.append(requirement)
    return extra


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit(__doc__)
    for requirement in image_only("pdserve", argv[0]):
        print(requirement)


if __name__ == "__main__":
    main(sys.argv[1:])
