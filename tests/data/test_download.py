"""Download against a local HTTP server: digests, resume with Range, restart, unreachable mirror.

Reference: the bytes the test server serves (and the arrays inside them); the server
records every request so the tests can assert that a Range request was made.
"""
import dataclasses
import hashlib
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from ringnet import datasets
from ringnet.data import download

from test_datasets_cli import cifar_batches, expected_cifar, make_mnist, read_h5, run_cli, write_cifar

pytestmark = pytest.mark.timeout(60)


class _Handler(BaseHTTPRequestHandler):
    """Serve ``server.files``; honour ``Range: bytes=N-`` unless told not to; cut transfers on request."""

    def do_GET(self):
        server = self.server
        name = self.path.rsplit("/", 1)[-1]
        header = self.headers.get("Range")
        server.requests.append((name, header))
        data = server.files.get(name)
        if data is None:
            self.send_error(404, "no such file")
            return
        start = 0
        if header and server.honour_range:
            start = int(header.split("=", 1)[1].split("-", 1)[0])
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        cut = server.cut_after.pop(name, None)
        # A cut sends part of the promised body, then the connection closes (HTTP/1.0).
        self.wfile.write(body if cut is None else body[:cut])

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.files, httpd.requests, httpd.cut_after, httpd.honour_range = {}, [], {}, True
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}/data/"
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def serve_mnist(server, folder):
    parts = make_mnist(folder, gz=True)
    for path in Path(folder).iterdir():
        server.files[path.name] = path.read_bytes()
    return parts


def trust_served(monkeypatch, server, name):
    """Make the digest table list the SHA-256 of what the test server serves."""
    remote = download.REMOTES[name]
    digests = {f: sha256(server.files[f]) for f in remote.sha256}
    monkeypatch.setitem(download.REMOTES, name, dataclasses.replace(remote, sha256=digests))


@pytest.mark.parametrize("keep_raw", [False, True], ids=["drop-raw", "keep-raw"])
def test_download_mnist_converts(tmp_path, server, monkeypatch, keep_raw):
    parts = serve_mnist(server, tmp_path / "served")
    trust_served(monkeypatch, server, "mnist")
    args = ["download", "mnist", "--dir", str(tmp_path / "d"), "--mirror", server.url]
    assert datasets.main(args + (["--keep-raw"] if keep_raw else [])) == 0
    got, classes = read_h5(tmp_path / "d" / "mnist.h5")
    for split, (images, labels) in parts.items():
        np.testing.assert_array_equal(got[split][0][:, 0], images, err_msg=f"{split} images")
        np.testing.assert_array_equal(got[split][1], labels, err_msg=f"{split} labels")
    raw = tmp_path / "d" / "raw" / "mnist"
    if keep_raw:
        assert {p.name: p.read_bytes() for p in raw.iterdir()} == server.files
    else:
        assert not (tmp_path / "d" / "raw").exists()
    assert sorted(name for name, _ in server.requests) == sorted(server.files)


def test_download_cifar10_converts(tmp_path, server, monkeypatch):
    batches = cifar_batches()
    archive = write_cifar(tmp_path / "cifar-10-python.tar.gz", batches, "tar.gz")
    server.files[archive.name] = archive.read_bytes()
    trust_served(monkeypatch, server, "cifar10")
    datasets.main(["download", "cifar10", "--dir", str(tmp_path / "d"), "--mirror", server.url])
    got, _ = read_h5(tmp_path / "d" / "cifar10.h5")
    for split, (images, labels) in expected_cifar(batches).items():
        np.testing.assert_array_equal(got[split][0], images, err_msg=f"{split} images")
        np.testing.assert_array_equal(got[split][1], labels, err_msg=f"{split} labels")


def test_digest_mismatch_refused(tmp_path, server):
    # The real digest table: the test-made files cannot match it.
    serve_mnist(server, tmp_path / "served")
    out = tmp_path / "d"
    result = run_cli("download", "mnist", "--dir", out, "--mirror", server.url)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ringnet: error: SHA-256 mismatch for "), result.stderr
    assert "removed" in lines[0]
    assert [p for p in out.rglob("*") if p.is_file()] == [], "no file left behind"


def test_resume_partial_file(tmp_path, server):
    data = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    server.files["blob.bin"] = data
    dest = tmp_path / "blob.bin"
    Path(str(dest) + ".part").write_bytes(data[:123_457])
    download.fetch([server.url + "blob.bin"], dest, sha256(data), progress=False)
    assert dest.read_bytes() == data
    assert server.requests == [("blob.bin", "bytes=123457-")]
    assert not Path(str(dest) + ".part").exists()


def test_resume_after_broken_connection(tmp_path, server):
    data = np.random.default_rng(1).integers(0, 256, 200_000, dtype=np.uint8).tobytes()
    server.files["blob.bin"] = data
    server.cut_after["blob.bin"] = 70_000
    dest = tmp_path / "blob.bin"
    download.fetch([server.url + "blob.bin"], dest, sha256(data), progress=False, retry_wait=0.01)
    assert dest.read_bytes() == data
    assert server.requests == [("blob.bin", None), ("blob.bin", "bytes=70000-")]


def test_server_ignoring_range_restarts(tmp_path, server):
    data = bytes(range(256)) * 500
    server.files["blob.bin"] = data
    server.honour_range = False
    dest = tmp_path / "blob.bin"
    # A stale prefix that does not match: appending to it would give a wrong file.
    Path(str(dest) + ".part").write_bytes(b"\xff" * 1000)
    download.fetch([server.url + "blob.bin"], dest, sha256(data), progress=False)
    assert dest.read_bytes() == data
    assert server.requests == [("blob.bin", "bytes=1000-")]


def test_complete_part_file_answered_416(tmp_path, server):
    data = b"complete file" * 100
    server.files["blob.bin"] = data
    dest = tmp_path / "blob.bin"
    Path(str(dest) + ".part").write_bytes(data)
    download.fetch([server.url + "blob.bin"], dest, sha256(data), progress=False)
    assert dest.read_bytes() == data
    assert server.requests == [("blob.bin", f"bytes={len(data)}-")]


def test_next_mirror_after_404(tmp_path, server):
    data = b"payload" * 1000
    server.files["blob.bin"] = data
    dest = tmp_path / "blob.bin"
    download.fetch([server.url + "missing/nothing.bin", server.url + "blob.bin"], dest, sha256(data),
                   progress=False)
    assert dest.read_bytes() == data
    with pytest.raises(download.Unreachable, match=r"cannot reach .*nothing\.bin \(HTTP 404"):
        download.fetch([server.url + "nothing.bin"], tmp_path / "x", sha256(data), progress=False)


def test_unreachable_server_clear_message(tmp_path):
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "d"
    started = time.monotonic()
    result = run_cli("download", "cifar10", "--dir", out, "--mirror", f"http://127.0.0.1:{port}/")
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ringnet: error: cannot reach http://127.0.0.1:{port}/"
                                                   "cifar-10-python.tar.gz ("), result.stderr
    assert "refused" in lines[0].lower()
    assert f"python -m ringnet.datasets convert cifar10 {out / 'raw' / 'cifar10' / 'cifar-10-python.tar.gz'}" \
           f" --out {out / 'cifar10.h5'}" in lines[0]
    assert elapsed < 20
    assert not (out / "cifar10.h5").exists()
    assert not (out / "raw").exists(), "empty raw/ folders left behind"


def test_unreachable_server_keeps_and_names_the_partial_file(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "d"
    part = out / "raw" / "cifar10" / "cifar-10-python.tar.gz.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"x" * 1234)
    result = run_cli("download", "cifar10", "--dir", out, "--mirror", f"http://127.0.0.1:{port}/")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"1234 bytes received are kept in {part}" in lines[0], result.stderr
    assert part.read_bytes() == b"x" * 1234


def test_download_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("RINGNET_DATA", str(tmp_path))
    assert download.download_dir() == tmp_path
    monkeypatch.delenv("RINGNET_DATA")
    import ringnet
    assert download.download_dir() == Path(ringnet.__file__).resolve().parent.parent / "datasets"
