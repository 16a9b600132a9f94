"""realm_jax.core.slices: a slice's one name gives gcloud's accelerator
type and its hosts (issue 68), from the chip table realm-aot compiles for."""

import pytest

from realm_jax.core import slices


@pytest.mark.parametrize("name, accelerator, hosts", [
    ("v4:4x4x4", "v4-128", 16), ("v4:2x2x4", "v4-32", 4),
    ("v5e:4x4", "v5litepod-16", 4), ("v5e:8x8", "v5litepod-64", 16),
    ("v5e:2x2", "v5litepod-4", 1), ("v5p:2x2x2", "v5p-16", 2)])
def test_a_slice_names_its_accelerator_type_and_hosts(name, accelerator,
                                                      hosts):
  assert slices.accelerator_type(name) == accelerator
  assert slices.hosts(name) == hosts


def test_a_bad_name_says_which_setting():
  with pytest.raises(ValueError, match="topology='v6:4x4' is not a TPU"):
    slices.accelerator_type("v6:4x4")
