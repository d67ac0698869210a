"""Tensor parallelism: the process group, the collectives, the overlapped row-parallel projection
and the slice policy that decides how many slices it uses."""
