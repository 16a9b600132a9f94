"""TPU pod slices: the chips' spec sheet and the slice names, one table.

A slice has one name, its topology (`"v5e:4x4"`, `"v4:4x4x4"`): realm-aot
compiles for it (`realm_jax.aot`), a pod recipe binds it (`TOPOLOGY`), and
the launcher (launch/tpu_pod.py, which reads this file without importing
realm_jax: standard library only here) derives from it gcloud's
accelerator type (`accelerator_type`) and the number of hosts.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
  """A TPU generation's public spec sheet (per chip).

  Attributes:
    generation: "v4", "v5e" or "v5p", as in topology names.
    peak_bf16_flops: dense bfloat16 FLOP/s.
    hbm_bytes_per_second: HBM bandwidth.
    hbm_bytes: HBM capacity.
    chip_config_name: `get_topology_desc`'s name for one chip (v4 and v5p
      run as one megacore device per chip).
    dims: the topology's dimensions (2 for v5e, 3 for v4 and v5p).
    pod_chips: chips in a whole pod, the largest slice (v4: 4,096; v5e:
      256, 16x16; v5p: 8,960).
  """
  generation: str
  peak_bf16_flops: float
  hbm_bytes_per_second: float
  hbm_bytes: int
  chip_config_name: str
  dims: int
  pod_chips: int


CHIPS = {
    "v4": Chip("v4", 275e12, 1.2e12, 32 * GIB, "megacore", 3, 4096),
    "v5e": Chip("v5e", 197e12, 819e9, 16 * GIB, "default", 2, 256),
    "v5p": Chip("v5p", 459e12, 2.76e12, 95 * GIB, "megacore", 3, 8960),
}
# Chips per host along each topology axis: 4 chips per TPU VM host (v4,
# v5p, and v5e pods larger than one host).
CHIPS_PER_HOST_BOUNDS = (2, 2, 1)


_TOPOLOGY = re.compile(r"^(?P<gen>v4|v5e|v5p):(?P<dims>\d+(?:x\d+)+)$")


def host_bounds(dims: Sequence[int]) -> tuple[int, int, int]:
  """A host's chips along each axis of a slice of `dims`: a slice smaller
  than a host (e.g. "v5e:1x1", "v4:2x2x1") is all on one."""
  dims3 = tuple(dims) + (1,) * (3 - len(dims))
  return tuple(min(b, d) for b, d in zip(CHIPS_PER_HOST_BOUNDS, dims3))


def parse_topology(name: str, field: str = "AotConfig.topology"
                   ) -> tuple[Chip, tuple[int, ...]]:
  """(chip, dims) of a topology name such as "v5e:4x4" or "v4:4x4x4".

  Raises:
    ValueError: naming the field and the accepted forms; a slice larger
      than its generation's pod, or whose chips do not divide into hosts
      (`host_bounds`), before the TPU compiler sees it.
  """
  match = _TOPOLOGY.match(name or "")
  if not match:
    raise ValueError(
        f"{field}={name!r} is not a TPU topology name: use "
        "<generation>:<dims> with generation v4, v5e or v5p, e.g. "
        "'v5e:4x4' (16 chips), 'v4:4x4x4' (64 chips), 'v5p:2x2x2'.")
  chip = CHIPS[match["gen"]]
  dims = tuple(int(d) for d in match["dims"].split("x"))
  if len(dims) != chip.dims or min(dims) < 1:
    example = "x".join(["2"] * chip.dims)
    raise ValueError(
        f"{field}={name!r}: a {chip.generation} topology has "
        f"{chip.dims} positive dimensions, e.g. '{chip.generation}:"
        f"{example}'.")
  chips = math.prod(dims)
  if chips > chip.pod_chips:
    raise ValueError(
        f"{field}={name!r} names {chips:,} chips, more than a "
        f"whole {chip.generation} pod ({chip.pod_chips:,}): realm-aot "
        "compiles for one slice of one pod; use a smaller topology, e.g. "
        f"'{chip.generation}:{'x'.join(['4'] * chip.dims)}'.")
  bounds = host_bounds(dims)
  dims3 = dims + (1,) * (3 - len(dims))
  if any(d % b for d, b in zip(dims3, bounds)):
    fixed = [-(-d // b) * b for d, b in zip(dims, bounds)]
    raise ValueError(
        f"{field}={name!r} does not divide into hosts: its "
        f"{'x'.join(map(str, dims))} chips do not tile into host bounds of "
        f"{'x'.join(map(str, bounds))} chips (chips_per_host_bounds: a TPU "
        f"VM host holds {'x'.join(map(str, CHIPS_PER_HOST_BOUNDS))}, fewer "
        "only along an axis where the whole slice is smaller). Make its "
        "first two dimensions 1 or multiples of 2, e.g. "
        f"'{chip.generation}:{'x'.join(map(str, fixed))}'.")
  return chip, dims


def hosts(name: str) -> int:
  """The TPU VM hosts of the slice `name` (4 chips each, fewer only in a
  slice smaller than a host)."""
  _, dims = parse_topology(name, field="topology")
  return math.prod(dims) // math.prod(host_bounds(dims))


# gcloud's accelerator types count TensorCores on v4 and v5p (2 per chip,
# one megacore device) and chips on v5e ("v5litepod").
_ACCELERATOR_PREFIX = {"v4": ("v4", 2), "v5e": ("v5litepod", 1),
                       "v5p": ("v5p", 2)}


def accelerator_type(name: str) -> str:
  """gcloud's `--accelerator-type` of the slice `name`, e.g. "v4:4x4x4"
  -> "v4-128", "v5e:4x4" -> "v5litepod-16", "v5p:2x2x2" -> "v5p-16"."""
  chip, dims = parse_topology(name, field="topology")
  prefix, per_chip = _ACCELERATOR_PREFIX[chip.generation]
  return f"{prefix}-{math.prod(dims) * per_chip}"
