"""Family "archive": tar, gzip and zip.

Archives placed in the environment are built here byte-for-byte deterministically (uncompressed
ustar and stored zip with fixed timestamps), so a generated task is the same on every machine.
"""

from __future__ import annotations

import io
import tarfile
import zipfile

from toy_envs import obstacles
from toy_envs.base import Check, Cmd, Family, File, Step, StepKind
from toy_envs.families.common import err, lit
from toy_envs.words import FRUITS


def make_tar(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        dirs = sorted({m.rsplit("/", 1)[0] for m in members if "/" in m})
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 1700000000
            tf.addfile(info)
        for name, data in sorted(members.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 1700000000
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def make_zip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for name, data in sorted(members.items()):
            info = zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.create_system = 3
            zf.writestr(info, data)
    return buf.getvalue()


def _word(rng) -> bytes:
    return f"{rng.choice(FRUITS)}\n".encode()


def _pack_dir(p, rng, state):
    d, a, b, c = p
    files = {f"{d}/{b}.txt": _word(rng), f"{d}/{c}.txt": _word(rng)}
    env = {k: File(v) for k, v in files.items()}
    # No read_only obstacle here: tar czf onto a read-only file races its gzip child, and prints
    # "Cannot write: Broken pipe" only sometimes (an output no corpus can know in advance).
    return Step(
        f"Make {a}.tar.gz from the directory {d}.",
        [Cmd(f"tar czf {a}.tar.gz {d}", reads=(d,), writes=(f"{a}.tar.gz",), **err("tar_c"))],
        [
            Check("archive_exists", f"assert os.path.isfile(path({lit(a + '.tar.gz')}))"),
            Check("archive_members", "import tarfile\n"
                  f"with tarfile.open(path({lit(a + '.tar.gz')}), 'r:gz') as t:\n"
                  f"    assert {lit(sorted(files))} == sorted(n for n in t.getnames() if n.endswith('.txt'))"),
            Check("dir_kept", f"assert os.path.isfile(path({lit(f'{d}/{b}.txt')}))"),
        ],
        files=env,
        creates=(f"{a}.tar.gz",),
    )


def _pack_files(p, rng, state, obstacle=""):
    a, b, c = p
    data = {f"{a}.txt": _word(rng), f"{b}.txt": _word(rng)}
    return Step(
        f"Make {c}.tar from {a}.txt and {b}.txt.",
        [Cmd(f"tar cf {c}.tar {a}.txt {b}.txt", reads=(f"{a}.txt", f"{b}.txt"), writes=(f"{c}.tar",), **err("tar_c"))],
        [
            Check("archive_exists", f"assert os.path.isfile(path({lit(c + '.tar')}))"),
            Check("archive_members", "import tarfile\n"
                  f"with tarfile.open(path({lit(c + '.tar')})) as t:\n"
                  f"    assert sorted(t.getnames()) == {lit(sorted(data))}"),
            Check("archive_content", "import tarfile\n"
                  f"with tarfile.open(path({lit(c + '.tar')})) as t:\n"
                  f"    assert t.extractfile({lit(a + '.txt')}).read() == {lit(data[a + '.txt'])}"),
        ],
        files={k: File(v) for k, v in data.items()} | ({f"{c}.tar": File(b"old\n", 0o444)} if obstacle else {}),
        creates=(f"{c}.tar",),
        obstacle=obstacles.read_only(f"{c}.tar", 0, "tar") if obstacle else None,
    )


def _extract(p, rng, state):
    a, d, b = p
    data = _word(rng)
    return Step(
        f"Extract {a}.tar.",
        [Cmd(f"tar xf {a}.tar", reads=(f"{a}.tar",), **err("tar_x"))],
        [
            Check("dir_extracted", f"assert os.path.isdir(path({lit(d)}))"),
            Check("file_extracted", f"assert read({lit(f'{d}/{b}.txt')}) == {lit(data.decode())}"),
            Check("archive_kept", f"assert os.path.isfile(path({lit(a + '.tar')}))"),
        ],
        files={f"{a}.tar": File(make_tar({f"{d}/{b}.txt": data}))},
        creates=(d,),
    )


def _extract_into(p, rng, state):
    a, d, b = p
    data = _word(rng)
    return Step(
        f"Extract {a}.tar into a new directory {d}.",
        [Cmd(f"mkdir {d}", writes=(d,)), Cmd(f"tar xf {a}.tar -C {d}", reads=(f"{a}.tar",), **err("tar_x"))],
        [
            Check("dir_exists", f"assert os.path.isdir(path({lit(d)}))"),
            Check("file_extracted", f"assert read({lit(f'{d}/{b}.txt')}) == {lit(data.decode())}"),
            Check("not_in_top", f"assert not os.path.exists(path({lit(b + '.txt')}))"),
        ],
        files={f"{a}.tar": File(make_tar({f"{b}.txt": data}))},
        creates=(d,),
    )


def _extract_to(p, rng, state, obstacle=""):
    a, d, b = p
    data = _word(rng)
    files = {f"{a}.tar": File(make_tar({f"{b}.txt": data})), f"{d}/README": File(b"extract here\n")}
    if obstacle == "missing_dir":  # d is not there
        del files[f"{d}/README"]
    return Step(
        f"Extract {a}.tar into {d}.",
        [Cmd(f"tar xf {a}.tar -C {d}", reads=(f"{a}.tar",), **err("tar_x"))],
        [
            Check("file_extracted", f"assert read({lit(f'{d}/{b}.txt')}) == {lit(data.decode())}"),
            Check("not_in_top", f"assert not os.path.exists(path({lit(b + '.txt')}))"),
            Check("archive_kept", f"assert os.path.isfile(path({lit(a + '.tar')}))"),
        ],
        files=files,
        creates=(d,) if obstacle else (),
        obstacle=obstacles.missing_dir(d, 0, "tar") if obstacle else None,
    )


def _gzip(p, rng, state, obstacle=""):
    (a,) = p
    data = _word(rng)
    files = {f"{a}.txt": File(data)}
    ob = None
    if obstacle == "needs_force":  # an older a.txt.gz is there
        files[f"{a}.txt.gz"] = File(b"old\n")
        ob = obstacles.needs_force(f"gzip {a}.txt", 0, f"gzip: {a}.txt.gz already exists;\tnot overwritten", 2)
    return Step(
        f"Compress {a}.txt with gzip.",
        [Cmd(f"gzip {a}.txt", reads=(f"{a}.txt",), **err("gzip"))],
        [
            Check("gz_exists", f"assert os.path.isfile(path({lit(a + '.txt.gz')}))"),
            Check("gz_content", "import gzip\n"
                  f"with gzip.open(path({lit(a + '.txt.gz')})) as f:\n    assert f.read() == {lit(data)}"),
            Check("original_gone", f"assert not os.path.exists(path({lit(a + '.txt')}))"),
        ],
        files=files,
        creates=(f"{a}.txt.gz",),
        obstacle=ob,
    )


def _unzip(p, rng, state):
    a, b = p
    data = _word(rng)
    return Step(
        f"Unzip {a}.zip.",
        [Cmd(f"unzip {a}.zip", output=f"Archive:  {a}.zip\n extracting: {b + '.txt':<24}\n",
             reads=(f"{a}.zip",), **err("unzip"))],
        [
            Check("file_extracted", f"assert os.path.isfile(path({lit(b + '.txt')}))"),
            Check("file_content", f"assert read({lit(b + '.txt')}) == {lit(data.decode())}"),
            Check("zip_kept", f"assert os.path.isfile(path({lit(a + '.zip')}))"),
        ],
        files={f"{a}.zip": File(make_zip({f"{b}.txt": data}))},
        creates=(f"{b}.txt",),
    )


def _zip(p, rng, state):
    a, b = p
    data = _word(rng)
    return Step(
        f"Make {b}.zip from {a}.txt.",
        [Cmd(f"zip {b}.zip {a}.txt", output=f"  adding: {a}.txt (stored 0%)\n",
             reads=(f"{a}.txt",), writes=(f"{b}.zip",),
             error=f"\tzip warning: name not matched: {{path}}\n\nzip error: Nothing to do! ({b}.zip)", error_code=12)],
        [
            Check("zip_exists", f"assert os.path.isfile(path({lit(b + '.zip')}))"),
            Check("zip_member", "import zipfile\n"
                  f"with zipfile.ZipFile(path({lit(b + '.zip')})) as z:\n"
                  f"    assert z.read({lit(a + '.txt')}) == {lit(data)}"),
            Check("source_kept", f"assert os.path.isfile(path({lit(a + '.txt')}))"),
        ],
        files={f"{a}.txt": File(data)},
        creates=(f"{b}.zip",),
    )


FAMILY = Family(
    "archive",
    (
        StepKind("pack_dir", 1, lambda r, n: (n.dir(), n.file(), n.file(), n.file()), _pack_dir),
        StepKind("pack_files", 1, lambda r, n: (n.file(), n.file(), n.file()), _pack_files, ("read_only",)),
        StepKind("extract", 1, lambda r, n: (n.file(), n.dir(), n.file()), _extract),
        StepKind("extract_into", 2, lambda r, n: (n.file(), n.dir(), n.file()), _extract_into),
        StepKind("extract_to", 1, lambda r, n: (n.file(), n.dir(), n.file()), _extract_to, ("missing_dir",)),
        StepKind("gzip", 1, lambda r, n: (n.file(),), _gzip, ("needs_force",)),
        StepKind("unzip", 1, lambda r, n: (n.file(), n.file()), _unzip),
        StepKind("zip", 1, lambda r, n: (n.file(), n.file()), _zip),
    ),
)
