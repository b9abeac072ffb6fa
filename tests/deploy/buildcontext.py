"""What `docker build` sends as its context: the files .dockerignore leaves, read the way Docker
reads the file (moby's patternmatcher: `*`, `?`, `**`, `!` to re-include, the last matching
line wins, and a line matching a parent directory matches everything under it)."""

from __future__ import annotations

import os
import re
from pathlib import Path


def _regex(pattern: str) -> re.Pattern[str]:
    out = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):  # `**/`: any number of directories, none included
                out.append("(?:.*/)?")
                i += 1
            else:
                out.append(".*")
            continue
        out.append("[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c))
        i += 1
    return re.compile("^" + "".join(out) + "$")


def read_patterns(dockerignore: Path) -> list[tuple[bool, re.Pattern[str]]]:
    """(re-include?, regex) per line, in order."""
    rules = []
    for raw in dockerignore.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        if negate:
            line = line[1:].strip()
        line = os.path.normpath(line.lstrip("/")).replace(os.sep, "/")
        rules.append((negate, _regex(line)))
    return rules


def is_excluded(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for negate, rx in rules:
        if any(rx.match(p) for p in prefixes):
            excluded = not negate
    return excluded


def context_files(root: Path, dockerignore: Path | None = None) -> list[str]:
    """Every file (relative, `/`-separated) that the build context of `root` holds."""
    rules = read_patterns(dockerignore or root / ".dockerignore")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            rel = rel_dir + name
            if not is_excluded(rel, rules):
                found.append(rel)
    return sorted(found)
