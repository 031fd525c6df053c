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
default_state_dir = cache_dir  # where the kept key lives unless --state-dir says


def write_key(path: Path) -> str:
    """A new key in a new private (0600) file ``path`` -> the key."""
    key = secrets.token_urlsafe(24)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(key + "\n")
    return key


def _kept(state_dir: Path, place) -> str:
    """A new key written whole in a private temporary file in ``state_dir`` (created), then put in place by
    ``place(tmp, path)`` (a reader never sees half a key) -> the key."""
    (path := Path(state_dir) / FILE).parent.mkdir(parents=True, exist_ok=True)
    key = write_key(tmp := path.with_name(f".{FILE}.{os.getpid()}.{secrets.token_hex(4)}.tmp"))
    try:
        place(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return key


def load_or_create(state_dir: Path) -> tuple[str, bool]:
    """The kept key -> (key, whether it was generated now). Two launchers starting at once agree on one: the
    new key is linked into place only if no key is there."""
    if not (path := Path(state_dir) / FILE).exists():
        try:
            return _kept(state_dir, os.link), True
        except FileExistsError:  # another launcher was first: use its key
            pass
    if (mode := stat.S_IMODE(path.stat().st_mode)) & 0o077:
        raise PermissionError(f"{path} is readable by others (mode {mode:o}): chmod 600 it, or rotate the key")
    if not (key := path.read_text().partition("\n")[0].strip()):
        raise ValueError(f"{path} holds no key: rotate it (python -m serving.security.admin_key rotate)")
    return key, False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serving.security.admin_key", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("path", "rotate"))
    ap.add_argument("--state-dir", type=Path, default=None, help=f"default: {default_state_dir()}")
    args = ap.parse_args(argv)
    state = args.state_dir or default_state_dir()
    if args.action == "rotate":  # a new kept key, renamed over the old one
        _kept(state, os.replace)
        print(f"a new admin key is in {state / FILE}; running servers keep the old one until they restart",
              file=sys.stderr)  # fmt: skip
    else:
        print(state / FILE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
