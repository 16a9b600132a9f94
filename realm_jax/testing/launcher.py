"""launch/tpu_pod.py as a module, for the tests (it is a script, not part
of the package)."""

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "launch", "tpu_pod.py")


def load_tpu_pod():
  """The launcher's module (`tpu_pod`), loaded once from its file."""
  if "tpu_pod" not in sys.modules:
    spec = importlib.util.spec_from_file_location("tpu_pod", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["tpu_pod"] = module
    spec.loader.exec_module(module)
  return sys.modules["tpu_pod"]
