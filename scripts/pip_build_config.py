"""Turns this host's effective pip configuration (``pip config list`` output: config files and
``PIP_*`` variables) into what a container build can use (scripts/image.sh):

- ``OUT/pip.conf``: one ``[global]``/``[install]`` file with every setting;
- the CA file (``cert``) copied to ``OUT/pip-ca`` and the constraints file to
  ``OUT/pip-constraints``, with the config pointing at ``/run/secrets/...`` where the build's
  secret mounts put them;
- on stdout, the local directories the config names (``find-links``, ``file://`` indexes), one a
  line, for read-only bind mounts at the same paths.

Usage: python3 scripts/pip_build_config.py PIP_CONFIG_LIST_OUTPUT OUT_DIR
"""

from __future__ import annotations

import ast
import configparser
import shutil
import sys
from pathlib import Path

SECRET_FILES = {"cert": "pip-ca", "constraint": "pip-constraints"}
PATH_LISTS = ("find-links", "index-url", "extra-index-url")


def parse(text: str) -> dict[tuple[str, str], str]:
    """``global.cert='/x'`` and ``:env:.find-links='/y'`` lines -> {(section, key): value}; the
    environment wins over files, as in pip, and counts as ``global``."""
    files: dict[tuple[str, str], str] = {}
    env: dict[tuple[str, str], str] = {}
    for line in text.splitlines():
        name, sep, raw = line.partition("=")
        if not sep:
            continue
        value = ast.literal_eval(raw.strip())
        scope, _, key = name.strip().rpartition(".")
        if scope.startswith(":env:"):
            env[("global", key)] = value
        else:
            files[(scope.rpartition(":")[2] or "global", key)] = value
    return {**files, **env}


def main(listing: Path, out: Path) -> None:
    settings = parse(listing.read_text())
    mounts: list[str] = []
    for (section, key), value in list(settings.items()):
        if key in SECRET_FILES and Path(value).is_file():
            shutil.copyfile(value, out / SECRET_FILES[key])
            settings[(section, key)] = f"/run/secrets/{SECRET_FILES[key]}"
        elif key in PATH_LISTS:
            for item in value.split():
                path = item.removeprefix("file://")
                if path.startswith("/") and Path(path).exists():
                    local = Path(path) if Path(path).is_dir() else Path(path).parent
                    # A simple index links to files beside it (../../files/x.whl): mount its parent.
                    if item.startswith("file://") and local.name == "simple":
                        local = local.parent
                    mounts.append(str(local))
    config = configparser.ConfigParser(interpolation=None)
    for (section, key), value in sorted(settings.items()):
        if not config.has_section(section):
            config.add_section(section)
        config.set(section, key, value)
    with (out / "pip.conf").open("w") as f:
        config.write(f)
    for path in dict.fromkeys(mounts):
        print(path)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
