"""The files a run writes, checked before it starts, and the lock a run holds on its checkpoint.

A run writes its outputs (``--save``, ``--json-file``, ``--trace``, ``$RINGNET_HEARTBEAT``)
only at the end or while it trains, hours after it started; whatever would make a write
fail or destroy something is found here first, on the rank that writes them:

* :func:`check_output`: the path names a regular file or nothing yet (not a folder, not a
  device, a FIFO or a socket, which a write that replaces its file whole would turn into a
  regular file, or an ``open`` would block on), does not end in ``/``, and the nearest
  folder above it that exists is a folder this process may write to (missing folders
  are made when the file is written).
* :func:`check_distinct`: no two of the run's files are one file, compared by device and
  inode (links followed, so a hard or symbolic link to the data set is the data set) and,
  for files that do not exist yet, by their resolved path. A checkpoint that is resumed
  from and saved to (``--resume ck.h5 --save ck.h5``, what ``--resume auto`` does) is the
  one pair that may share a file: it is read whole before it is replaced.
* :class:`CheckpointLock`: a run holds an exclusive ``flock`` on ``<checkpoint>.lock`` next
  to the checkpoint (its resolved path) from start-up to its end, so a second run with the
  same ``--save`` refuses to start, naming the host and process that hold it. The kernel
  drops the lock when the process ends in any way (a crash, ``kill -9``); a run that ends
  normally removes the lock file, one that was killed leaves it, empty of meaning (the
  next run takes it over).
"""
import errno
import os
import socket
import stat

from ringnet.errors import UsageError

__all__ = ["check_output", "file_kind", "check_distinct", "same_file_key", "check_run_files",
           "CheckpointLock", "lock_path", "LOCK_SUFFIX"]

LOCK_SUFFIX = ".lock"
# flock's errors on a file system that cannot lock files: the run goes on unlocked
_NO_LOCKS = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK}


def file_kind(mode):
    """Name what a non-regular file of ``mode`` is."""
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _stat(path):
    """``os.stat`` (links followed), or None where nothing is there yet."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def check_output(what, path, example="out.json", folder=True, label=None):
    """Raise UsageError, one line starting with ``label``, unless a file can be written
    whole at ``path``: a regular file or nothing yet there, a name that does not end in
    ``/``, and (``folder``) the nearest existing folder above it writable.

    ``what``: the flag or variable that gave the path (``--save``); ``example``: a file name
    to suggest; ``label``: how the message starts (default ``what path``).
    """
    text = os.fspath(path)
    label = f"{what} {text}" if label is None else label
    if not text:
        raise UsageError(f"{what} is empty; give a file name such as {example}")
    if text.endswith(("/", os.sep)) or os.path.basename(text) in (".", ".."):
        raise UsageError(f"{label}: it ends in '/', which names a folder; give a file name "
                         f"such as {example}")
    try:
        st = _stat(text)
    except OSError as exc:
        raise UsageError(f"{label} cannot be examined ({exc.strerror or exc})") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise UsageError(f"{label}: it is a folder; give a file name such as {example}")
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{label}: it is {file_kind(st.st_mode)}, not a regular file; the "
                             f"run writes a regular file there, so give the path of one")
    if not folder:
        return
    existing = os.path.dirname(os.path.abspath(text))
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UsageError(f"{label}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{label}: folder {existing} is not writable")


def same_file_key(path):
    """Return what identifies the file at ``path``: (device, inode) where it exists (links
    followed), else its resolved path."""
    text = os.fspath(path)
    try:
        st = os.stat(text)
        return ("inode", st.st_dev, st.st_ino)
    except OSError:
        return ("path", os.path.realpath(text))


def check_distinct(files, may_share=()):
    """Raise UsageError, in one line naming both, when two of ``files`` are one file.

    ``files``: ``(name, shown, noun, role, path)`` each: ``name`` the flag or variable
    (``--save``), ``shown`` how the message names it (``--dataset digits (dd/digits.h5)``),
    ``noun`` what the file is (``data set``), ``role`` ``"input"`` or ``"output"``; entries
    whose path is None are left out. ``may_share``: pairs of names that may be one file.
    """
    seen = []
    allowed = {frozenset(pair) for pair in may_share}
    for name, shown, noun, role, path in files:
        if path is None:
            continue
        key = same_file_key(path)
        for other_name, other_shown, other_noun, other_role, other_key in seen:
            if key != other_key or frozenset((name, other_name)) in allowed:
                continue
            first = (other_name, other_shown, other_noun, other_role)
            second = (name, shown, noun, role)
            if first[3] == "output" and second[3] == "input":
                first, second = second, first
            if first[3] == "input" and second[3] == "output":
                why = (f"writing the {second[2]} would destroy the {first[2]}; give "
                       f"{second[0]} another path")
            elif first[3] == "output":
                why = (f"the {first[2]} and the {second[2]} would overwrite each other; give "
                       f"them different paths")
            else:
                why = f"one file cannot be both the {first[2]} and the {second[2]}"
            raise UsageError(f"{first[1]} and {second[1]} are the same file: {why}")
        seen.append((name, shown, noun, role, key))


def check_run_files(save=None, json_file=None, trace=None, heartbeat=None, resume=None,
                    data_file=None):
    """Raise UsageError (one line) unless a training run's outputs can be written and none
    of its files is another.

    The outputs (``--save``, ``--json-file``, ``--trace`` and ``heartbeat``, the file
    ``$RINGNET_HEARTBEAT`` names) pass :func:`check_output` (the heartbeat, written in place
    and allowed to fail, only its kind); no two of the data set (``data_file``: its name as
    given and its path, None when unknown or synthetic), the checkpoint resumed from
    (``resume``), the outputs and the checkpoint's lock file are one file, except
    ``--resume`` and ``--save``.
    """
    files = []
    if data_file is not None:
        name, path = data_file
        shown = f"--dataset {name}" + ("" if os.fspath(path) == os.fspath(name) else f" ({path})")
        files.append(("--dataset", shown, "data set", "input", path))
    if resume:
        files.append(("--resume", f"--resume {resume}", "checkpoint resumed from", "input", resume))
    for flag, path, noun, example in (("--save", save, "checkpoint", "ck.h5"),
                                      ("--json-file", json_file, "summary", "summary.json"),
                                      ("--trace", trace, "trace", "trace.json")):
        if path:
            check_output(flag, path, example, label=(f"cannot write checkpoint {path} (--save)"
                                                     if flag == "--save" else None))
            files.append((flag, f"{flag} {path}", noun, "output", path))
    if heartbeat:
        check_output("RINGNET_HEARTBEAT", heartbeat, "heartbeat", folder=False)
        files.append(("RINGNET_HEARTBEAT", f"RINGNET_HEARTBEAT={heartbeat}", "heartbeat file",
                      "output", heartbeat))
    if save:
        files.append(("lock", f"the lock file {lock_path(save)} of --save",
                      "checkpoint's lock file", "output", lock_path(save)))
    check_distinct(files, may_share=[("--resume", "--save")])


def lock_path(checkpoint):
    """Return the lock file of ``checkpoint``: its resolved path (a link's target, which is
    what is written) with :data:`LOCK_SUFFIX` added."""
    return os.path.realpath(os.fspath(checkpoint)) + LOCK_SUFFIX


def _holder(fd):
    try:
        text = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or "a process that has not named itself yet"


class CheckpointLock:
    """An exclusive ``flock`` on :func:`lock_path` of ``checkpoint``, held until
    :meth:`release` or the end of the process; raises UsageError naming ``what`` (the
    flag) and the holder when another process holds it.

    The lock file holds ``host H, process P`` of its holder. It is created if missing and
    removed by :meth:`release`; a process that takes the lock checks that the file it
    locked is still the one at the path (a releasing holder may have removed it in
    between), and starts again if not. On a file system that cannot lock files (``flock``
    fails with ENOSYS, EOPNOTSUPP or ENOLCK: Lustre mounted without ``flock``) nothing is
    held and :attr:`note` says so.
    """

    def __init__(self, checkpoint, what="--save"):
        import fcntl
        self.path = lock_path(checkpoint)
        self.fd = None
        self.note = None        # why the checkpoint is not locked, where the file system cannot
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        while True:
            try:        # the mode of a plain open(): 0666 less the umask
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
            except OSError as exc:
                raise UsageError(f"{what} {checkpoint}: cannot create its lock file "
                                 f"{self.path} ({exc.strerror or exc})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise UsageError(f"{what} {checkpoint} is in use by another run ({holder}; lock "
                                 f"file {self.path}): two runs saving one checkpoint would "
                                 f"replace each other's; wait for that run to end or choose "
                                 f"another {what} path") from None
            except OSError as exc:
                os.close(fd)
                if exc.errno in _NO_LOCKS:
                    # a file system without locks (Lustre mounted without flock): run unlocked
                    self.note = (f"note: {what} {checkpoint}: the file system does not lock "
                                 f"files ({exc.strerror or exc}), so a second run with this "
                                 f"{what} is not refused")
                    return
                raise UsageError(f"{what} {checkpoint}: cannot lock {self.path} "
                                 f"({exc.strerror or exc})") from None
            mine = os.fstat(fd)
            try:
                now = os.stat(self.path, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                break
            os.close(fd)        # removed or replaced while we locked it: take the new one
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()}, process {os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self):
        """Remove the lock file and drop the lock (idempotent)."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            now = os.stat(self.path, follow_symlinks=False)
            mine = os.fstat(fd)
            if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                os.remove(self.path)
        except OSError:
            pass
        finally:
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False
