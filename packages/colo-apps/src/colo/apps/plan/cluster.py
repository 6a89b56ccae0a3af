"""`Cluster`: the hardware a layout runs on (devices, memory, peak FLOP/s, links), named presets, and validation.

Presets (peak dense FLOP/s from the vendors' data sheets; link figures per GPU and direction):

- ``8xh100``: nodes of 8 H100 SXM 80 GB (989 TFLOP/s bf16, 3.35 TB/s HBM3), NVLink 4 (450 GB/s per direction),
  400 Gb/s InfiniBand per GPU between nodes;
- ``h100-96gb-500w``: torchtitan's Llama 3.1 benchmark hardware (pytorch/torchtitan,
  ``benchmarks/llama3_h100_202412_torchtitan.md``): Grand Teton hosts of 8 H100 with 96 GB HBM2e at 2.4 TB/s, NVLink,
  400 Gb/s RDMA per GPU, at the default 500 W power limit; torchtitan notes its peak lies between SXM and NVL and is
  not known exactly, so the SXM peak is used and the calibration row absorbs the difference;
- ``a100``: DGX A100 80 GB nodes (312 TFLOP/s bf16, 2.0 TB/s HBM2e), NVLink 3 (300 GB/s per direction), 8 x 200 Gb/s
  HDR InfiniBand per node (torchtitan's A100 runs, Narayanan et al. 2021's Selene);
- ``cpu``: this machine: one node, 2 ranks sharing its cores, gloo over loopback; figures from
  ``benchmarks/plan_cpu.py``'s calibration. Its peak is a measured matmul rate, reached at efficiency 1.0, so the MFU
  `colo plan` prints for it is the share of the step spent computing at that rate (96% for tiny-deepseek at seq
  128), not a share of a hardware peak.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

GB = 1e9
GiB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Fractions of peak reached per op class (fixed from one calibration row per hardware)."""

    matmul: float = 0.6
    """Share of the peak FLOP/s the linear layers reach."""
    attention: float = 0.4
    """Share of the peak FLOP/s flash attention reaches (causal, the half of the scores computed)."""
    memory: float = 0.8
    """Share of the memory bandwidth element-wise ops and the optimizer step reach."""
    link: float = 0.8
    """Share of the link bandwidth collectives reach (NCCL's bus bandwidth over the link rate)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"Efficiency.{f.name}={value!r} must be a fraction in (0, 1]")


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """A homogeneous cluster: ``nodes`` nodes of ``devices_per_node`` devices."""

    name: str
    devices_per_node: int
    """Devices (ranks) per node."""
    nodes: int = 1
    """Nodes."""
    device_memory: float
    """Usable bytes per device."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s per compute precision (``fp32``, ``bf16``, ``fp16``)."""
    memory_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    intra_bandwidth: float
    """Bytes/s per device and direction between devices of a node."""
    inter_bandwidth: float
    """Bytes/s per device and direction between nodes."""
    intra_latency: float = 10e-6
    """Seconds per collective call inside a node."""
    inter_latency: float = 25e-6
    """Seconds per collective call across nodes."""
    host_memory: float = float("inf")
    """Host bytes per device (ZeRO-Offload, offloaded checkpointing)."""
    host_bandwidth: float = 25 * GB
    """Bytes/s between host and device (PCIe)."""
    efficiency: Efficiency = field(default_factory=Efficiency)
    """Fractions of peak per op class."""
    memory_reserve: float = 0.0
    """Bytes per device the model leaves free (allocator fragmentation, CUDA context, communication buffers)."""

    def __post_init__(self) -> None:
        for name in ("devices_per_node", "nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Cluster {self.name!r}: {name}={value!r} must be a positive integer")
        for name in ("device_memory", "memory_bandwidth", "intra_bandwidth", "inter_bandwidth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"Cluster {self.name!r}: {name}={value!r} must be a positive number of bytes(/s)")
        if not self.peak_flops or any(not (isinstance(v, (int, float)) and v > 0) for v in self.peak_flops.values()):
            raise ValueError(
                f"Cluster {self.name!r}: peak_flops={self.peak_flops!r} must map precisions (fp32, bf16, fp16) to "
                "positive FLOP/s"
            )
        unknown = set(self.peak_flops) - {"fp32", "bf16", "fp16"}
        if unknown:
            raise ValueError(f"Cluster {self.name!r}: peak_flops has unknown precisions {sorted(unknown)}")
        for name in ("intra_latency", "inter_latency", "memory_reserve"):
            if getattr(self, name) < 0:
                raise ValueError(f"Cluster {self.name!r}: {name} must be >= 0")

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def usable_memory(self) -> float:
        """Device bytes a layout may use."""
        return self.device_memory - self.memory_reserve

    def flops(self, precision: str) -> float:
        """Peak FLOP/s in ``precision``."""
        if precision not in self.peak_flops:
            raise ValueError(
                f"cluster {self.name!r} has no peak_flops for precision={precision!r}; it lists "
                f"{sorted(self.peak_flops)}"
            )
        return self.peak_flops[precision]

    def with_nodes(self, nodes: int) -> Cluster:
        """The same hardware with ``nodes`` nodes."""
        return dataclasses.replace(self, nodes=nodes)

    def link(self, span: int, size: int | None = None) -> tuple[float, float]:
        """(bus bandwidth bytes/s, latency s) of a collective over a group of ``size`` ranks spanning ``span``
        consecutive ranks.

        Inside a node: the device's NVLink bandwidth. Across nodes: NCCL runs one ring (channel) per NIC, so a
        collective over a group with ``k`` ranks on each node moves its inter-node share through ``k`` NICs per node:
        ``k`` times a device's NIC bandwidth (at most the NVLink bandwidth), as nccl-tests' bus bandwidth of a
        whole-node all-reduce approaches the node's aggregate NIC rate."""
        if span <= self.devices_per_node:
            return self.intra_bandwidth * self.efficiency.link, self.intra_latency
        size = size or 2
        nodes = -(-span // self.devices_per_node)
        per_node = max(1, size // nodes)
        bandwidth = min(self.inter_bandwidth * per_node, self.intra_bandwidth)
        return bandwidth * self.efficiency.link, self.inter_latency


CLUSTERS: dict[str, Cluster] = {
    "8xh100": Cluster(
        name="8xh100",
        devices_per_node=8,
        device_memory=80 * GiB,
        peak_flops={"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
        memory_bandwidth=3.35e12,
        intra_bandwidth=450 * GB,
        inter_bandwidth=50 * GB,  # 400 Gb/s per GPU
        memory_reserve=4 * GiB,
        efficiency=Efficiency(matmul=0.5, attention=0.35, memory=0.8, link=0.8),
    ),
    "h100-96gb-500w": Cluster(
        name="h100-96gb-500w",
        devices_per_node=8,
        device_memory=96 * GiB,
        peak_flops={"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
        memory_bandwidth=2.4e12,
        intra_bandwidth=450 * GB,
        inter_bandwidth=50 * GB,
        memory_reserve=4 * GiB,
        efficiency=Efficiency(matmul=0.4, attention=0.3, memory=0.8, link=0.8),
    ),
    "a100": Cluster(
        name="a100",
        devices_per_node=8,
        device_memory=80 * GiB,
        peak_flops={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
        memory_bandwidth=2.0e12,
        intra_bandwidth=300 * GB,
        inter_bandwidth=25 * GB,  # 200 Gb/s per GPU
        memory_reserve=4 * GiB,
        efficiency=Efficiency(matmul=0.6, attention=0.45, memory=0.8, link=0.8),
    ),
    "cpu": Cluster(
        name="cpu",
        devices_per_node=2,
        device_memory=4 * GiB,
        peak_flops={"fp32": 20e9, "bf16": 2e9},
        memory_bandwidth=5 * GB,
        intra_bandwidth=1 * GB,
        inter_bandwidth=0.1 * GB,
        intra_latency=100e-6,
        inter_latency=1e-3,
        efficiency=Efficiency(matmul=1.0, attention=0.5, memory=1.0, link=1.0),
    ),
}
"""Named clusters (one node each; `get_cluster` sets the node count)."""


def get_cluster(name: str, *, nodes: int = 1, **overrides) -> Cluster:
    """The preset cluster ``name`` with ``nodes`` nodes (and any field changed).

    Raises:
        ValueError: an unknown name (the message lists the presets) or an invalid field.
    """
    if name not in CLUSTERS:
        raise ValueError(
            f"unknown cluster {name!r}; choose one of {sorted(CLUSTERS)} or describe one with Cluster(...)"
        )
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(Cluster)})
    if unknown:
        raise ValueError(f"get_cluster({name!r}): {unknown} are not Cluster fields")
    return dataclasses.replace(CLUSTERS[name], nodes=nodes, **overrides)
