"""Mount an episode's writable root, then exec the jail (run as host root, alone, with ``-I -S``).

A task on prepared layers gets Docker's container semantics: one root filesystem per episode,
writable everywhere, shared by the agent's jail and then the verifier's, and thrown away at the
end. It is an overlay whose lower layers (the task's layers over the base rootfs) are never
written, and whose upper directory lives in the sandbox's own directory::

    <target>  =  overlay(lowerdir = idmapped(layer) : ... : idmapped(rootfs),
                         upperdir = <upper>/u, workdir = <upper>/w)

The jail's root is the unprivileged host uid H (a user namespace maps 0 -> H), and the layers'
files are owned by host root, which H may not write. So each lower layer is mounted through an
*idmapped* mount that shows host uid 0 as H (and k as H + k): inside the jail root owns the image's files, as in
Docker (``echo x > /usr/local/bin/tool``, ``useradd``, ``mkdir /server`` work), and every write
goes to the upper directory, on disk as uid H. /tmp and the workdir are directories of the same
mount, so a rename between them works (it is EXDEV across two mounts).

For the verifier, ``--pin PATH`` puts back the pristine image's PATH (from a read-only overlay of
the same lower layers, without the episode's changes), so that what test.sh runs itself (bash,
the Python interpreter and its standard library, the shared libraries, the dynamic loader's
configuration) is the image's, not a copy the agent replaced: a path absent from the image is
hidden. Which paths: ``minirsi.env.sandbox.bwrap.VERIFIER_PINS``. ``--overlay PATH ROOT NAMES`` then
makes a pinned PATH a read-only overlay of directories of ours over the pristine one: the
package index's clean copies of what the agent installed from it (minirsi/env/wheelhouse.py).

This file is executed by path as a script (``python3 -I -S overlay_root.py ... -- CMD``) inside
``unshare -m``, so it imports nothing of minirsi and uses only the standard library (ctypes for
the mount API: open_tree, mount_setattr, move_mount; Linux >= 5.19 for idmapped overlay layers).
"""

from __future__ import annotations

import ctypes
import os
import sys

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442  # x86_64 and aarch64 share them
_OPEN_TREE_CLONE, _OPEN_TREE_CLOEXEC, _AT_EMPTY_PATH = 1, 0o2000000, 0x1000
_MOVE_MOUNT_F_EMPTY_PATH, _MOUNT_ATTR_IDMAP, _CLONE_NEWUSER = 0x4, 0x00100000, 0x10000000
_MS_RDONLY, _MS_BIND, _MS_REC, _MNT_DETACH = 1, 4096, 16384, 2
# The idmapped layers show host id k as H + k for k < _IDS: root's files are the jail root's; a
# file of another owner or group (/etc/shadow: group shadow) keeps a valid id, so that the overlay
# can copy it up when root writes it (the jail maps only H: it sees such ids as nobody/nogroup).
_IDS = 65536
_AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None, what: str) -> None:
    _check(_libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                       data.encode() if data else None), what)


def _userns(uid: int) -> int:
    """An fd of a user namespace mapping k -> uid + k (a child creates it; we write its maps)."""
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: unshare, say so, wait until the parent has the namespace's fd
        try:
            os.close(ready_r)
            os.close(hold_w)
            _check(_libc.unshare(_CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
            os.write(ready_w, b"1")
            os.read(hold_r, 1)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(hold_r)
    try:
        if os.read(ready_r, 1) != b"1":
            raise OSError("could not create the user namespace of the idmapped mounts")
        with open(f"/proc/{pid}/uid_map", "w") as f:
            f.write(f"0 {uid} {_IDS}")
        with open(f"/proc/{pid}/setgroups", "w") as f:
            f.write("deny")
        with open(f"/proc/{pid}/gid_map", "w") as f:
            f.write(f"0 {uid} {_IDS}")
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(ready_r)
        os.close(hold_w)
        os.waitpid(pid, 0)


def _idmapped(source: str, target: str, userns_fd: int) -> None:
    """Mount `source` at `target` showing its uid/gid 0 as the namespace's host uid."""
    fd = _check(_libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, source.encode(), _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC),
                f"open_tree {source}")
    try:
        attr = _MountAttr(_MOUNT_ATTR_IDMAP, 0, 0, userns_fd)
        _check(_libc.syscall(_SYS_MOUNT_SETATTR, fd, b"", _AT_EMPTY_PATH, ctypes.byref(attr), ctypes.sizeof(attr)),
               f"idmapped mount of {source} (Linux >= 5.19 and a filesystem that supports it)")
        _check(_libc.syscall(_SYS_MOVE_MOUNT, fd, b"", _AT_FDCWD, target.encode(), _MOVE_MOUNT_F_EMPTY_PATH),
               f"move_mount to {target}")
    finally:
        os.close(fd)


def _detached(source: str, readonly: bool) -> int:
    """A detached copy of the mount tree at `source` (an fd for move_mount)."""
    fd = _check(_libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, source.encode(),
                              _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC | _AT_RECURSIVE), f"open_tree {source}")
    if readonly:
        attr = _MountAttr(_MOUNT_ATTR_RDONLY, 0, 0, 0)
        _check(_libc.syscall(_SYS_MOUNT_SETATTR, fd, b"", _AT_EMPTY_PATH | _AT_RECURSIVE, ctypes.byref(attr),
                             ctypes.sizeof(attr)), f"read-only {source}")
    return fd


def _attach(fd: int, target: str) -> None:
    _check(_libc.syscall(_SYS_MOVE_MOUNT, fd, b"", _AT_FDCWD, target.encode(), _MOVE_MOUNT_F_EMPTY_PATH),
           f"move_mount to {target}")
    os.close(fd)


def _remove(path: str) -> None:
    """Remove a file, symlink or whole tree, following no symlink (os only: this runs chrooted in
    the episode's root, where the host's standard library cannot be imported)."""
    if os.path.isdir(path) and not os.path.islink(path):
        for entry in os.scandir(path):
            _remove(entry.path)
        os.rmdir(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _pin(rel: str) -> None:
    """Make /rel the pristine image's (a read-only bind, or the same symlink); hide a file the
    image lacks behind an empty, non-executable one. Runs chrooted in the episode's root, so the
    agent's symlinks resolve inside it."""
    src, dst = os.path.join(_PRISTINE, rel), "/" + rel
    if os.path.islink(src):
        link = os.readlink(src)
        if not (os.path.islink(dst) and os.readlink(dst) == link):
            _remove(dst)
            os.symlink(link, dst)
        return
    if not os.path.lexists(src):
        if os.path.lexists(dst) and not os.path.isdir(dst):
            _remove(dst)
            open(dst, "w").close()
            _mount(_EMPTY, dst, None, _MS_BIND, None, f"hide {rel}")
        return
    if os.path.islink(dst) or (os.path.lexists(dst) and os.path.isdir(src) != os.path.isdir(dst)):
        _remove(dst)
    if not os.path.lexists(dst):
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.mkdir(dst) if os.path.isdir(src) else open(dst, "w").close()
    _mount(src, dst, None, _MS_BIND | _MS_REC, None, f"pin {rel}")


_PRISTINE, _EMPTY = "/.minirsi-pristine", "/.minirsi-empty"


def _real_dir(path: str, uid: int) -> None:
    """Make every component of `path` a real directory (a symlink or file in the way is
    replaced; what is created belongs to the jail's root): the agent cannot redirect or block a
    mount point (Docker creates a WORKDIR the same way)."""
    current = "/"
    for part in [p for p in path.split("/") if p]:
        current = os.path.join(current, part)
        if os.path.islink(current) or (os.path.lexists(current) and not os.path.isdir(current)):
            _remove(current)
        if not os.path.lexists(current):
            os.mkdir(current)
            os.chown(current, uid, uid)


def _inside(uid: int, workdir: str, dirs: list[str], binds: list[tuple[int, str]], pristine: int | None,
            pins: list[str], overlays: list[tuple[int, str]]) -> None:
    """Chrooted in the episode's root (a child process): the directories, the binds, the pins,
    then the overlays (over pinned directories)."""
    for path in [workdir, *dirs, *(path for _, path in binds)]:
        _real_dir(path, uid)
    for fd, path in binds:
        _attach(fd, path)
    if pristine is None:
        return
    for path in (_PRISTINE, _EMPTY):
        _remove(path)
    os.mkdir(_PRISTINE)
    _attach(pristine, _PRISTINE)
    open(_EMPTY, "w").close()
    os.chmod(_EMPTY, 0o444)
    for rel in pins:
        _pin(rel.lstrip("/"))
    _check(_libc.umount2(_PRISTINE.encode(), _MNT_DETACH), "detach the pristine image")
    os.rmdir(_PRISTINE)
    for fd, path in overlays:  # mount points inside pinned (read-only) directories: they exist
        _attach(fd, path)


def _site_overlay(i: int, stage: str, pristine_dir: str, path: str, root: str, names: str) -> int:
    """A read-only overlay of the directories ROOT/<name> (first on top) over the pristine
    image's PATH: a detached mount for move_mount. The lower directories are named relative to
    ROOT (overlayfs resolves them from the working directory), which keeps the mount options
    short whatever the number of wheels."""
    below = os.path.join(pristine_dir, path.lstrip("/"))
    empty = os.path.join(stage, "empty")
    os.makedirs(empty, exist_ok=True)
    target = os.path.join(stage, f"overlay-{i}")
    os.makedirs(target, exist_ok=True)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        lowers = names.split(":") + [below if os.path.isdir(below) else empty]
        _mount("overlay", target, "overlay", _MS_RDONLY, "lowerdir=" + ":".join(lowers), f"overlay at {path}")
    finally:
        os.chdir(cwd)
    return _detached(target, readonly=True)


_USAGE = """overlay_root.py --uid H --stage DIR --upper DIR --target DIR [--lower DIR]... [--workdir PATH]
    [--cgroup DIR] [--dir PATH]... [--bind SRC PATH]... [--pin PATH]... -- COMMAND...
  --uid      the host uid the jail's root maps to
  --lower    a lower layer, top first (the rootfs last)
  --stage    a directory of ours for the idmapped mount points
  --upper    the episode's directory: u/ (changes) and w/ (overlay work)
  --target   where the root is mounted
  --workdir  created (owned by the jail's root) if missing
  --cgroup   a cgroup directory this process (and so the jail) joins first
  --dir      a mount point the jail needs: made a real directory
  --bind     bind SRC read-only at PATH inside the root
  --pin      a path the verifier takes from the pristine image
  --overlay  PATH ROOT NAMES: PATH (a pinned directory) becomes a read-only overlay of the
             directories ROOT/<name> (NAMES colon-separated, first on top) over the pristine one"""


class _Args:
    uid = 0
    stage = upper = target = cgroup = None
    workdir = "/"

    def __init__(self) -> None:
        self.lower, self.dir, self.bind, self.pin, self.overlay = [], [], [], [], []


def _parse(argv: list[str]) -> tuple[_Args, list[str]]:
    """The options before ``--`` (argparse would cost this per-jail helper 7 ms of imports)."""
    if "--" not in argv:
        raise SystemExit(f"overlay_root.py: no -- before the command\n{_USAGE}")
    split = argv.index("--")
    args, opts, i = _Args(), argv[:split], 0
    while i < len(opts):
        name, n = opts[i], {"--bind": 3, "--overlay": 4}.get(opts[i], 2)
        values = opts[i + 1:i + n]
        if not name.startswith("--") or len(values) != n - 1 or not hasattr(args, name[2:]):
            raise SystemExit(f"overlay_root.py: bad option {name!r}\n{_USAGE}")
        key = name[2:]
        if isinstance(getattr(args, key), list):
            getattr(args, key).append(tuple(values) if key in ("bind", "overlay") else values[0])
        else:
            setattr(args, key, int(values[0]) if key == "uid" else values[0])
        i += n
    if None in (args.stage, args.upper, args.target) or not args.uid:
        raise SystemExit(f"overlay_root.py: --uid, --stage, --upper and --target are required\n{_USAGE}")
    return args, argv[split + 1:]


def main(argv: list[str]) -> None:
    args, command = _parse(argv)

    if args.cgroup:
        with open(os.path.join(args.cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    userns = _userns(args.uid)
    staged = []
    for i, layer in enumerate(args.lower):
        d = os.path.join(args.stage, str(i))
        os.makedirs(d, exist_ok=True)
        _idmapped(layer, d, userns)
        staged.append(d)
    os.close(userns)
    upper, work = os.path.join(args.upper, "u"), os.path.join(args.upper, "w")
    for d in (upper, work):
        os.makedirs(d, exist_ok=True)
    os.chown(upper, args.uid, args.uid)  # the root directory's owner: the jail's root
    _mount("overlay", args.target, "overlay", 0, f"lowerdir={':'.join(staged)},upperdir={upper},workdir={work}",
           f"overlay at {args.target}")
    binds = [(_detached(src, readonly=True), path) for src, path in args.bind]
    pristine, overlays = None, []
    if args.pin:
        d = os.path.join(args.stage, "pristine")
        os.makedirs(d, exist_ok=True)
        _mount("overlay", d, "overlay", _MS_RDONLY, f"lowerdir={':'.join(staged)}", "the pristine image")
        overlays = [(_site_overlay(i, args.stage, d, *spec), spec[0]) for i, spec in enumerate(args.overlay)]
        pristine = _detached(d, readonly=True)
    # Everything inside the root may be the agent's (a symlink to a host path, say): work on it
    # chrooted, in a child, so that no path resolves outside it.
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.chroot(args.target)
            os.chdir("/")
            _inside(args.uid, args.workdir, args.dir, binds, pristine, args.pin, overlays)
        except BaseException as e:  # any failure must fail the launch, never leave a half-pinned root
            print(f"minirsi overlay_root: {type(e).__name__}: {e}", file=sys.stderr)
            code = 125
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(125)
    os.execvp(command[0], command)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except OSError as e:
        print(f"minirsi overlay_root: {e}", file=sys.stderr)
        sys.exit(125)
