"""Download MNIST and CIFAR-10 from their canonical mirrors: SHA-256 checked, resumable, then converted."""
import hashlib
import http.client
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ringnet.errors import InputError, SetupError

__all__ = ["Remote", "REMOTES", "Unreachable", "download_dir", "file_sha256", "fetch", "download"]

CHUNK = 1 << 20


@dataclass(frozen=True)
class Remote:
    """Where a data set lives: base URLs tried in order, file name -> SHA-256, what to convert."""

    mirrors: tuple
    sha256: dict
    convert_source: str  # path below the raw folder that the converter reads ("." = the folder)


# Digests as published in tensorflow-datasets' url_checksums (mnist.txt) for MNIST, and
# the SHA-256 of the cs.toronto.edu cifar-10-python.tar.gz (its MD5 c58f3010...349a is
# the one torchvision checks).
REMOTES = {
    "mnist": Remote(
        mirrors=("https://ossci-datasets.s3.amazonaws.com/mnist/",
                 "https://storage.googleapis.com/cvdf-datasets/mnist/",
                 "http://yann.lecun.com/exdb/mnist/"),
        sha256={
            "train-images-idx3-ubyte.gz": "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
            "train-labels-idx1-ubyte.gz": "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
            "t10k-images-idx3-ubyte.gz": "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
            "t10k-labels-idx1-ubyte.gz": "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
        },
        convert_source="."),
    "cifar10": Remote(
        mirrors=("https://www.cs.toronto.edu/~kriz/",),
        sha256={"cifar-10-python.tar.gz": "6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce"},
        convert_source="cifar-10-python.tar.gz"),
}


class Unreachable(SetupError):
    """No mirror delivered the file. ``download`` sets ``source`` (the file or folder the
    converter reads) and ``out`` (the .h5 it would write), so a caller can say how to
    finish by hand."""
    source = None
    out = None


class _Interrupted(Exception):
    """The transfer started but broke off; the .part file keeps what arrived."""


def download_dir():
    """Return where downloads and conversions go: ``$RINGNET_DATA`` if set, else
    :func:`~ringnet.data.catalog.default_data_dir` (the ``datasets/`` folder)."""
    env = os.environ.get("RINGNET_DATA")
    if env:
        return Path(env)
    from ringnet.data.catalog import default_data_dir
    return default_data_dir()


def file_sha256(path):
    """Return the hex SHA-256 of the file at ``path``."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _reason(exc):
    reason = getattr(exc, "reason", None) or exc
    return " ".join(str(reason).split()) or type(exc).__name__


def _transfer(url, part, timeout, progress):
    """Append the rest of ``url`` to ``part`` (Range request), or restart it if Range is ignored."""
    offset = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"User-Agent": "ringnet-datasets"})
    if offset:
        request.add_header("Range", f"bytes={offset}-")
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and offset:
            return  # the .part already holds the whole file; the digest check decides
        raise Unreachable(f"HTTP {exc.code} {_reason(exc)}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
        raise Unreachable(_reason(exc)) from None
    with response:
        if offset and response.status == 206:
            content_range = response.headers.get("Content-Range", "")
            try:
                start = int(content_range.split()[1].split("-")[0])
            except (IndexError, ValueError):
                start = None
            if start != offset:
                raise _Interrupted(f"server answered Range {offset}- with {content_range!r}")
            mode = "ab"
        else:  # 200: a server that ignores Range sends the whole file again
            mode, offset = "wb", 0
        length = response.headers.get("Content-Length")
        length = int(length) if length and length.isdigit() else None
        received = 0
        with open(part, mode) as f, tqdm(total=None if length is None else offset + length,
                                         initial=offset, unit="B", unit_scale=True, unit_divisor=1024,
                                         desc=part.name[:-len(".part")], file=sys.stderr,
                                         disable=None if progress else True, leave=False) as bar:
            try:
                while chunk := response.read(CHUNK):
                    f.write(chunk)
                    received += len(chunk)
                    bar.update(len(chunk))
            except (OSError, http.client.HTTPException) as exc:
                raise _Interrupted(_reason(exc)) from None
    if length is not None and received != length:
        raise _Interrupted(f"connection closed after {received} of {length} bytes")


def fetch(urls, dest, sha256, attempts=3, timeout=30.0, progress=True, retry_wait=0.5):
    """Download ``dest`` from the first URL that works, resuming ``dest.part``; verify SHA-256.

    A connection that cannot be opened moves on to the next URL at once; one that breaks
    off mid-transfer is resumed from the same URL up to ``attempts`` times. A digest
    mismatch removes the file and raises :class:`~ringnet.errors.InputError`;
    no URL delivering it raises :class:`Unreachable`.
    """
    dest = Path(dest)
    if dest.is_file():
        if file_sha256(dest) == sha256:
            return dest
        dest.unlink()  # a stale or damaged copy: fetch it again
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    failure = None
    for url in urls:
        for attempt in range(attempts):
            try:
                _transfer(url, part, timeout, progress)
            except Unreachable as exc:
                failure = (url, str(exc))
                break
            except _Interrupted as exc:
                failure = (url, str(exc))
                time.sleep(retry_wait * 2 ** attempt)
                continue
            actual = file_sha256(part)
            if actual != sha256:
                part.unlink()
                raise InputError(f"SHA-256 mismatch for {dest.name} from {url}: expected {sha256}, "
                                 f"got {actual}; the file was removed")
            os.replace(part, dest)
            return dest
    url, reason = failure
    raise Unreachable(f"cannot reach {url} ({reason})")


def _converter(name):
    from ringnet.data import convert
    return {"mnist": convert.convert_mnist, "cifar10": convert.convert_cifar10}[name]


def download(name, directory=None, mirror=None, keep_raw=False, force=False, attempts=3,
             timeout=30.0, progress=True, log=None):
    """Fetch data set ``name`` into ``directory``/raw/``name``, convert to ``directory``/``name``.h5."""
    if name not in REMOTES:
        raise InputError(f"unknown data set {name!r}: choose {', '.join(REMOTES)}")
    log = log or (lambda message: None)
    remote = REMOTES[name]
    directory = Path(directory) if directory is not None else download_dir()
    out = directory / f"{name}.h5"
    if out.exists() and not force:
        log(f"{out} already exists (use --force to download and convert again)")
        return out
    raw = directory / "raw" / name
    bases = (mirror,) if mirror else remote.mirrors
    bases = [base if base.endswith("/") else base + "/" for base in bases]
    source = raw / remote.convert_source
    for file_name, digest in remote.sha256.items():
        log(f"fetching {file_name}")
        try:
            fetch([base + file_name for base in bases], raw / file_name, digest,
                  attempts=attempts, timeout=timeout, progress=progress)
        except Unreachable as exc:
            part = raw / (file_name + ".part")
            if part.is_file() and part.stat().st_size:
                exc = Unreachable(f"{exc}; the {part.stat().st_size} bytes received are kept in "
                                  f"{part} and the next run resumes from there")
            else:
                part.unlink(missing_ok=True)
                _remove_empty(raw, raw.parent)
            exc.source, exc.out = source, out
            raise exc from None
    _converter(name)(source, out)
    if not keep_raw:
        for file_name in remote.sha256:
            (raw / file_name).unlink(missing_ok=True)
        _remove_empty(raw, raw.parent)
    log(f"wrote {out}")
    return out


def _remove_empty(*folders):
    """Remove ``folders`` in order while they are empty (stop at the first that is not)."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty (other files the user keeps there) or already gone
            break
