"""The operator's admin key (it adds and removes voices), kept across restarts in ``<state dir>/admin_key``
(mode 0600, generated on first use): ``rotate`` replaces it (running servers keep the old key until they
restart), ``path`` prints where it is. docs/security.md ("The admin key")."""

from __future__ import annotations

import argparse
import os
import secrets
import stat
import sys
from pathlib import Path

from engine.config import cache_dir

FILE = "admin_key"


def default_state_dir() -> Path:
    return cache_dir()


def _read(path: Path) -> str:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise PermissionError(f"{path} is readable by others (mode {mode:o}): chmod 600 it, or rotate the key")
    key = path.read_text().partition("\n")[0].strip()
    if not key:
        raise ValueError(f"{path} holds no key: rotate it (python -m serving.security.admin_key rotate)")
    return key


def write_key(path: Path) -> str:
    """A new key in a new private (0600) file ``path`` -> the key."""
    key = secrets.token_urlsafe(24)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(key + "\n")
    return key


def _written(state_dir: Path) -> tuple[str, Path, Path]:
    """A new key in a private temporary file in ``state_dir`` (created) -> (key, that file, the key's path)."""
    (path := Path(state_dir) / FILE).parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{FILE}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    return write_key(tmp), tmp, path


def load_or_create(state_dir: Path) -> tuple[str, bool]:
    """The kept key -> (key, whether it was generated now). Two launchers starting at once agree on one: the
    key is written whole, then linked into place only if no key is there (a reader never sees half a key)."""
    if (path := Path(state_dir) / FILE).exists():
        return _read(path), False
    key, tmp, path = _written(state_dir)
    try:
        os.link(tmp, path)
    except FileExistsError:  # another launcher was first: use its key
        return _read(path), False
    finally:
        tmp.unlink()
    return key, True


def rotate(state_dir: Path) -> str:
    """A new kept key, written whole then renamed over the old one (a reader never sees half a key)."""
    key, tmp, path = _written(state_dir)
    os.replace(tmp, path)
    return key


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serving.security.admin_key", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("path", "rotate"))
    ap.add_argument("--state-dir", type=Path, default=None, help=f"default: {default_state_dir()}")
    args = ap.parse_args(argv)
    state = args.state_dir or default_state_dir()
    if args.action == "rotate":
        rotate(state)
        print(f"a new admin key is in {state / FILE}; running servers keep the old one until they restart",
              file=sys.stderr)  # fmt: skip
    else:
        print(state / FILE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
