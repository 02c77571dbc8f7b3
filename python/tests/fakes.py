"""Stand-ins the tests give the tracer in place of torch objects that need a process group."""

from __future__ import annotations

import torch


class FakeMesh:
    """What the tracer reads of a DeviceMesh: names, shape, this rank's coordinate."""

    def __init__(self, names, shape, coord):
        self.mesh_dim_names = names
        self.mesh = torch.zeros(shape)
        self._coord = coord

    def get_coordinate(self):
        return list(self._coord)
