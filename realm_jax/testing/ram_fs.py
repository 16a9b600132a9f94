"""`ram://` paths for etils.epath: a non-local filesystem for tests.

TensorFlow's `ram://` filesystem (tf.io.gfile) behaves like an object store
here: files can be written without creating their directory, `os` calls and
`np.load(mmap_mode=...)` cannot open them, and it needs no network. epath
only knows gs://, s3://, az:// and hf://, so this module registers a path
class for `ram://` that goes through the same TensorFlow backend as gs://.
After `register()`, `epath.Path("ram://x/y")` works like a GCS path, which
lets tests run the workdir code (publication, loading, caching) on a path
that is not on the local disk.
"""

from __future__ import annotations

import posixpath

from etils import epath
from etils.epath import backend as backend_lib
from etils.epath import gpath

PREFIX = "ram://"
_SCHEME = "ram"


class RamPath(gpath.PosixGPath):
  """An epath.Path on TensorFlow's in-memory `ram://` filesystem."""

  def __new__(cls, *parts):
    full = "/".join(str(p) for p in parts)
    if full.startswith(PREFIX):  # Stored as /ram/..., like gs:// -> /gs/.
      parts = ("/" + _SCHEME + "/" + full[len(PREFIX):],)
    return super().__new__(cls, *parts)

  @property
  def _uri_scheme(self):
    if len(self.parts) >= 2 and self.parts[:2] == ("/", _SCHEME):
      return _SCHEME
    return None

  @property
  def _backend(self):
    return backend_lib.tf_backend

  @property
  def _path_str(self) -> str:
    if self._uri_scheme:
      return posixpath.join(PREFIX, *self.parts[2:])
    return super()._path_str

  def open(self, mode: str = "r", **kwargs):
    # TensorFlow's ram:// appends when "w" opens an existing file; an
    # object store (and every other filesystem) replaces it.
    if "w" in mode and self.exists():
      self.unlink()
    return super().open(mode, **kwargs)


_registered = False


def register() -> None:
  """Makes `epath.Path("ram://...")` a RamPath (idempotent)."""
  global _registered
  if not _registered:
    epath.register_path_cls(PREFIX)(RamPath)
    _registered = True


def unique_root(name: str) -> str:
  """A fresh `ram://` directory name (the filesystem is process-global)."""
  import uuid  # pylint: disable=g-import-not-at-top
  return f"{PREFIX}{name}-{uuid.uuid4().hex[:12]}"
