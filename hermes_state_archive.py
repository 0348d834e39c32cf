"""The whole-home backup archive: which files of a home go in, the zip and its manifest of
SHA-256s, and for a restore the checks of an archive (member names and kinds, manifest, sizes)
and its unpacking, checksum by checksum, into a scratch folder.

The one user of zipfile: hermes_state imports this module only when a backup or a restore runs,
so `import hermes_state` pulls no zipfile in. Never opens a SessionDB or the live store and never
moves a file of the home: SessionDB.backup takes the SQLite snapshots, hermes_state.restore_home
holds the writer lock, checks the unpacked store and swaps the files in, all or nothing.
"""

import collections
import contextlib
import hashlib
import json
import os
import posixpath
import re
import shutil
import sqlite3
import stat
import tempfile
import time
import zipfile
import zlib
from pathlib import Path

from hermes_state_common import FILE_MODE, SIDECAR_SUFFIXES
from hermes_state_lockguard import _connections_held, _file_key, _store_of

BACKUP_MANIFEST = "hermes_backup.json"
BACKUP_FORMAT = "hermes_state backup v1"
BACKUP_MAX_BYTES = 64 * 1024 ** 3
SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3", ".db3")
# A restore leaves this much free behind it: a tenth of what it unpacks, at least 64 MiB.
RESTORE_FREE_MARGIN = 64 * 1024 ** 2
# Past the floor, a backup may unpack to at most this many times its own size. Deflate tops out
# near 1032:1; backups of the fixture stores and of 2,000 messages measured 2.3-2.6:1, a fresh
# empty store 40:1 (250 KB, under the floor), so 100 stops decompression bombs and nothing a home
# really holds.
RESTORE_MAX_RATIO = 100
RESTORE_RATIO_FLOOR = 64 * 1024 ** 2
# What zipfile raises on a damaged archive, beyond BadZipFile.
DAMAGED_ARCHIVE = (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError)
# The live store's companions: never archived, and refused in an archive (SQLite would replay
# a sidecar).
STORE_COMPANIONS = SIDECAR_SUFFIXES + (".lock",)


def refused(why):
    """The one-sentence ValueError of a restore refused before anything moved."""
    return ValueError(f"backup refused: {why}; nothing was restored")


# -- backup ----------------------------------------------------------------------------------------

def home_files(home, db_path, out_path):
    """Every regular file of the home except the live store, its sidecars, the sidecars of other
    SQLite files, and the archive itself."""
    skip = {Path(str(db_path) + suffix) for suffix in ("",) + STORE_COMPANIONS} | {out_path}
    skip_keys = {_file_key(path) for path in skip} - {None}
    for path in sorted(home.rglob("*")):
        if not path.is_file() or path.is_symlink() or path in skip or path.resolve() in skip \
                or _file_key(path) in skip_keys:
            continue
        store = Path(_store_of(path))
        if store != path and may_be_sqlite(store):
            continue  # its store goes in as a snapshot; a copy of a live sidecar is worse than none
        yield path


def may_be_sqlite(path):
    """Backed up through SQLite: our connections hold it, or its name says it is a database."""
    return path.suffix.lower() in SQLITE_SUFFIXES or _connections_held(path) > 0


def snapshot(source, target_path):
    """Copy the database of connection `source` to `target_path`, as one self-contained file;
    returns that."""
    target = sqlite3.connect(target_path)
    try:
        source.backup(target)
        target.execute("PRAGMA journal_mode=DELETE")
    finally:
        target.close()
    return target_path


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_backup_zip(out_path, members):
    """The archive of `members` ((path, name) pairs), written to a new 0600 file beside
    `out_path` and then renamed over it: an existing file's mode is not kept (a 0644 file would
    leave the home's secrets readable), a link there is replaced, not followed, and a failure
    leaves no partial archive. Returns {"archive", "files"}."""
    for _path, name in members:
        if name_problem(name):  # a restore would refuse the whole archive for it
            raise ValueError(f"backup refused: a restore cannot put back {name!r} "
                             f"({name_problem(name)}); nothing was written")
    manifest = {"format": BACKUP_FORMAT, "created_at": time.time(), "files": []}
    fd, temporary = tempfile.mkstemp(prefix=f".{out_path.name[:80]}.", suffix=".part",
                                     dir=out_path.parent)
    try:
        with os.fdopen(fd, "wb") as raw:
            with zipfile.ZipFile(raw, "w", zipfile.ZIP_DEFLATED) as archive:
                for path, name in members:
                    archive.write(path, name)
                    manifest["files"].append(
                        {"name": name, "bytes": path.stat().st_size, "sha256": sha256_file(path)})
                archive.writestr(BACKUP_MANIFEST, json.dumps(manifest, indent=2))
            raw.flush()
            os.fsync(raw.fileno())  # whole on disk before the name: a power cut leaves no torn zip
        os.replace(temporary, out_path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    return {"archive": str(out_path), "files": [f["name"] for f in manifest["files"]]}


# -- restore: checks before anything moves ---------------------------------------------------------

def open_archive(archive_path):
    """The zipfile.ZipFile of `archive_path`; ValueError when it is no zip archive."""
    if not zipfile.is_zipfile(archive_path):
        raise refused(f"{archive_path} is not a zip archive")
    return zipfile.ZipFile(archive_path)


# A Windows drive ("C:x" is relative to C:'s current folder there); elsewhere ':' is a plain
# character of a file name (notes:2024.txt).
DRIVE = re.compile(r"[A-Za-z]:")


def name_problem(name):
    """Why `name` may not be a member of a backup, or None. A member unpacks to exactly its name
    under the home: relative, '/'-separated, in its normal form (no '.', '..' or empty part),
    which is how backup writes every name."""
    if not isinstance(name, str) or not name:
        return "an empty name"
    if name.startswith("/") or DRIVE.match(name) or (os.name == "nt" and ("\\" in name
                                                                           or ":" in name)):
        return "an absolute path"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "a '.', '..' or empty part"
    if posixpath.normpath(name) != name:
        return "not in its normal form"
    return None


def _member_kind_problem(info):
    """Why zip entry `info` cannot be restored as a file, or None: backup writes regular files
    only, and zipfile would unpack a link as a file holding its target and a folder entry as an
    error."""
    if info.is_dir():
        return f"{info.filename!r} is a folder entry, and a backup holds files only"
    kind = stat.S_IFMT(info.external_attr >> 16) if info.create_system == 3 else 0
    if kind == stat.S_IFLNK:
        return f"{info.filename!r} is a symbolic link, and a backup holds files only"
    if kind not in (0, stat.S_IFREG):
        return f"{info.filename!r} is not a regular file"
    return None


def check_archive(archive, archive_path, home, store_name):
    """{name: manifest entry} of a backup whose members are files, each named once in normal form
    and listed in the manifest with `store_name` among them, and whose claimed sizes (zipfile
    stops unpacking a member at its claim) fit the disk and are no decompression bomb;
    ValueError (refused) otherwise."""
    infos = archive.infolist()
    for info in infos:
        problem = _member_kind_problem(info)
        if problem:
            raise refused(problem)
    try:
        manifest = json.loads(archive.read(BACKUP_MANIFEST))
        listed = [entry["name"] for entry in manifest["files"]]
        files = {entry["name"]: entry for entry in manifest["files"]}
    except (KeyError, ValueError, TypeError) as exc:
        raise refused(f"no readable {BACKUP_MANIFEST} ({exc})") from None
    names = [info.filename for info in infos]
    companions = {store_name + suffix for suffix in STORE_COMPANIONS}
    unsafe = sorted({str(n) for n in names + listed if name_problem(n) or n in companions})
    if unsafe:
        raise refused(f"unsafe file names {unsafe[:5]}")
    twice = sorted({name for counts in (collections.Counter(names),
                                        collections.Counter(map(str, listed)))
                    for name, count in counts.items() if count > 1})
    if twice:
        raise refused(f"it names a file more than once {twice[:5]}")
    if set(names) - {BACKUP_MANIFEST} != set(listed) or store_name not in files:
        raise refused(f"its files do not match its manifest, or it has no {store_name}")
    total = sum(info.file_size for info in infos if info.filename != BACKUP_MANIFEST)
    where = next(parent for parent in (home, *home.parents) if parent.exists())
    free = shutil.disk_usage(where).free
    needed = total + max(total // 10, RESTORE_FREE_MARGIN)
    if needed > free:
        raise refused(f"it unpacks to {total} bytes and {where} has {free} bytes free "
                      f"(a restore needs {needed} with its margin)")
    packed = os.path.getsize(archive_path)
    if total > max(RESTORE_MAX_RATIO * packed, RESTORE_RATIO_FLOOR):
        raise refused(f"it unpacks to {total} bytes, more than {RESTORE_MAX_RATIO} times "
                      f"its own {packed} bytes")
    if total > BACKUP_MAX_BYTES:
        raise refused(f"it unpacks to {total} bytes; the limit is {BACKUP_MAX_BYTES}")
    return files


def unpack_verified(archive, files, scratch):
    """Unpack every member of `files` into the folder `scratch`, each checked against its
    SHA-256, with its archived mode minus group/world write; ValueError (refused) on a
    mismatch."""
    for name, entry in files.items():
        info = archive.getinfo(name)
        path = Path(archive.extract(info, scratch))
        if path != scratch / name:  # zipfile rewrites names it finds unsafe; none pass the checks
            raise refused(f"{name!r} would unpack to {path}")
        if sha256_file(path) != entry["sha256"]:
            raise refused(f"{name} does not match its SHA-256")
        # As archived on Unix (create_system 3), minus group/world write.
        mode = info.external_attr >> 16
        os.chmod(path, mode & 0o755 if info.create_system == 3 and mode else FILE_MODE)
