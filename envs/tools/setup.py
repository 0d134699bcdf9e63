"""Workspace set-up (stdlib only), run on the host as the sandbox's unprivileged user, never as root: `write_all`
(called in a forked child that dropped to that user, envs/environment.py), or as a script reading
{"files": {relative path: text}} as JSON on stdin, creates them under the current directory (a fresh, empty
workspace). Each path is checked again here (relative, no `..`, no empty or `.` component); directories are made
one component at a time, and no component or file is ever opened through a link (O_NOFOLLOW, O_EXCL), so nothing
is written outside the workspace whatever the spec says. Exit 0, or 1 with the offending path on stderr."""

import contextlib
import json
import os
import sys


def bad(rel):
    parts = rel.split("/")
    if not rel or rel.startswith("/") or "\\" in rel or "\x00" in rel:
        return "not a relative path"
    if any(p in ("", ".", "..") for p in parts):
        return "has an empty, '.' or '..' component"
    return None


def write(root_fd, rel, text):
    *dirs, name = rel.split("/")
    fd = os.dup(root_fd)
    try:
        for d in dirs:
            with contextlib.suppress(FileExistsError):
                os.mkdir(d, 0o777, dir_fd=fd)
            nxt = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666, dir_fd=fd)
        with os.fdopen(out, "w", encoding="utf-8") as f:
            f.write(text)
    finally:
        os.close(fd)


def write_all(files, root_dir="."):
    """Write every file under `root_dir`; the first refusal as "'path': why", or None."""
    old = os.umask(0)
    root = os.open(root_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for rel, text in files.items():
            why = bad(rel)
            if why is None:
                try:
                    write(root, rel, text)
                except OSError as e:
                    why = f"{type(e).__name__}: {e.strerror}"
            if why:
                return f"{rel!r}: {why}"
        return None
    finally:
        os.close(root)
        os.umask(old)


def main():
    why = write_all(json.loads(sys.stdin.read())["files"])
    if why:
        print(why, file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
