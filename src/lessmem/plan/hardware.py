"""Hardware for planning: memory tiers, their capacities and sustained bandwidths.

Three tiers, as capacity planning draws them: device memory (HBM on a GPU, DRAM on a CPU),
host RAM reached over PCIe, and local NVMe. Bandwidths are decimal (1 GB/s = 10^9 B/s)
as vendors quote them; capacities are binary (GiB) as vendors' spec sheets give them.

PCIe: theoretical per-lane rate = GT/s × encoding / 8 (Gen3+ use 128b/130b), so Gen4 x16
= 16 × 16 × 128/130 / 8 = 31.5 GB/s. Sustained DMA is about 79% of that; the constant
is pinned so Gen4 x16 gives 25 GB/s exactly.

Example:
    >>> from lessmem.plan.hardware import get_hardware, pcie_bandwidth
    >>> round(pcie_bandwidth(4, 16, sustained=False) / 1e9, 1), pcie_bandwidth(4, 16) / 1e9
    (31.5, 25.0)
    >>> get_hardware("h100").hbm_bw / 1e12
    3.35
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

GT_PER_S = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}
ENCODING = {1: 8 / 10, 2: 8 / 10, 3: 128 / 130, 4: 128 / 130, 5: 128 / 130, 6: 242 / 256}
SUSTAINED_FRACTION = 25e9 / (16 * 16.0 * (128 / 130) / 8 * 1e9)  # Gen4 x16 -> 25 GB/s
GiB = 1024**3


def pcie_bandwidth(gen: int, width: int, sustained: bool = True) -> float:
    """Bytes/s of a PCIe link, one direction."""
    if gen not in GT_PER_S:
        raise ValueError(f"PCIe gen={gen!r}; allowed: {', '.join(map(str, GT_PER_S))}")
    if width not in (1, 2, 4, 8, 16):
        raise ValueError(f"PCIe width=x{width!r}; allowed: x1, x2, x4, x8, x16")
    theoretical = GT_PER_S[gen] * 1e9 * ENCODING[gen] * width / 8
    return theoretical * (SUSTAINED_FRACTION if sustained else 1.0)


@dataclass(frozen=True)
class Hardware:
    """One machine. ``pcie_gen=None`` means device memory *is* host memory (a CPU)."""

    name: str
    description: str
    hbm_bw: float  # device memory bandwidth, bytes/s
    hbm_capacity: int  # bytes
    pcie_gen: int | None = 4
    pcie_width: int = 16
    host_ram: int = 256 * GiB
    nvme_bw: float = 5e9  # sustained read, bytes/s (PCIe Gen4 x4 SSD)
    pcie_bw_override: float | None = None
    pcie_latency_s: float = 7.5e-6  # per transfer, typically 5–10 µs
    nvme_latency_s: float = 35e-6  # per transfer, typically 20–50 µs

    def __post_init__(self):
        for k in ("hbm_bw", "nvme_bw"):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"hardware {self.name!r}: {k}={v!r} must be a positive bandwidth")
        for k in ("hbm_capacity", "host_ram"):
            v = getattr(self, k)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"hardware {self.name!r}: {k}={v!r} must be a positive byte count")
        if self.pcie_gen is not None:
            pcie_bandwidth(self.pcie_gen, self.pcie_width)  # validates gen and width
        if self.pcie_bw_override is not None and not self.pcie_bw_override > 0:
            raise ValueError(f"hardware {self.name!r}: pcie_bw={self.pcie_bw_override!r} must be positive")

    @property
    def unified(self) -> bool:
        """Device memory is host memory (no PCIe hop for offloaded KV)."""
        return self.pcie_gen is None and self.pcie_bw_override is None

    @property
    def pcie_bw(self) -> float | None:
        if self.pcie_bw_override is not None:
            return float(self.pcie_bw_override)
        if self.pcie_gen is None:
            return None
        return pcie_bandwidth(self.pcie_gen, self.pcie_width)

    @property
    def pcie_bw_theoretical(self) -> float | None:
        if self.pcie_gen is None:
            return None
        return pcie_bandwidth(self.pcie_gen, self.pcie_width, sustained=False)

    def tiers(self) -> list[dict]:
        """(tier, bandwidth, capacity, latency) from fastest to slowest."""
        out = [{"tier": "device", "label": "HBM" if not self.unified else "RAM",
                "bandwidth": float(self.hbm_bw), "capacity": self.hbm_capacity, "latency_s": 0.0}]
        if not self.unified:
            out.append({"tier": "host", "label": f"host RAM over {self.link_label()}",
                        "bandwidth": self.pcie_bw, "capacity": self.host_ram,
                        "latency_s": self.pcie_latency_s})
        out.append({"tier": "nvme", "label": "NVMe", "bandwidth": float(self.nvme_bw),
                    "capacity": None, "latency_s": self.nvme_latency_s})
        return out

    def link_label(self) -> str:
        if self.pcie_bw_override is not None and self.pcie_gen is None:
            return "custom link"
        return f"PCIe Gen{self.pcie_gen} x{self.pcie_width}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(pcie_bw=self.pcie_bw, pcie_bw_theoretical=self.pcie_bw_theoretical, unified=self.unified)
        return d


def _gpu(name, desc, bw, cap_gib, gen=4, host_gib=512, nvme=5e9):
    return Hardware(name, desc, bw, int(cap_gib * GiB), gen, 16, int(host_gib * GiB), nvme)


HARDWARE_PRESETS: dict[str, Hardware] = {
    h.name: h
    for h in (
        _gpu("generic-gpu", "a generic data-centre GPU: 80 GiB HBM at 1,500 GB/s (low end of HBM), "
             "PCIe Gen4 x16 (25 GB/s sustained), NVMe Gen4 x4 (5 GB/s)", 1.5e12, 80, host_gib=256),
        _gpu("h100", "NVIDIA H100 SXM5 80 GB, HBM3 3.35 TB/s, PCIe Gen5 x16", 3.35e12, 80, gen=5),
        _gpu("h100-pcie", "NVIDIA H100 PCIe 80 GB, HBM2e 2.0 TB/s, PCIe Gen5 x16", 2.0e12, 80, gen=5),
        _gpu("h200", "NVIDIA H200 SXM 141 GB, HBM3e 4.8 TB/s, PCIe Gen5 x16", 4.8e12, 141, gen=5,
             host_gib=1024),
        _gpu("a100-80g", "NVIDIA A100 SXM4 80 GB, HBM2e 2.039 TB/s, PCIe Gen4 x16", 2.039e12, 80),
        _gpu("a100-40g", "NVIDIA A100 SXM4 40 GB, HBM2 1.555 TB/s, PCIe Gen4 x16", 1.555e12, 40),
        _gpu("l4", "NVIDIA L4 24 GB, GDDR6 300 GB/s, PCIe Gen4 x16", 300e9, 24, host_gib=128),
        _gpu("rtx-4090", "NVIDIA GeForce RTX 4090 24 GB, GDDR6X 1,008 GB/s, PCIe Gen4 x16",
             1.008e12, 24, host_gib=64, nvme=7e9),
        _gpu("mi300x", "AMD Instinct MI300X 192 GB, HBM3 5.3 TB/s, PCIe Gen5 x16", 5.3e12, 192, gen=5,
             host_gib=1024),
        Hardware("laptop-cpu", "a laptop CPU: 32 GiB LPDDR5 at ~100 GB/s, no discrete GPU "
                 "(device memory is host memory), NVMe 3 GB/s", 100e9, 32 * GiB, None, 16,
                 32 * GiB, 3e9),
        Hardware("desktop-cpu", "a desktop CPU: 64 GiB dual-channel DDR5 ~80 GB/s, NVMe 5 GB/s",
                 80e9, 64 * GiB, None, 16, 64 * GiB, 5e9),
    )
}
HW_ALIASES = {"h100-sxm": "h100", "a100": "a100-80g", "a100-80gb": "a100-80g", "4090": "rtx-4090",
              "rtx4090": "rtx-4090", "laptop": "laptop-cpu", "cpu": "laptop-cpu",
              "default": "generic-gpu", "mi300": "mi300x", "l4-24g": "l4"}
DEFAULT_HARDWARE = "generic-gpu"


def hardware_choices() -> str:
    return ", ".join(HARDWARE_PRESETS)


def get_hardware(name: str | Hardware, **overrides) -> Hardware:
    """A preset by name (case-insensitive), with any field overridden.

    Overrides: ``hbm_bw``, ``hbm_capacity``, ``pcie_gen``, ``pcie_width``, ``pcie_bw``
    (sustained bytes/s, replaces the gen/width estimate), ``host_ram``, ``nvme_bw``.
    """
    if isinstance(name, Hardware):
        hw = name
    else:
        key = str(name).strip().lower().replace("_", "-").replace(" ", "-")
        key = HW_ALIASES.get(key, key)
        if key not in HARDWARE_PRESETS:
            raise ValueError(f"unknown hardware {name!r}; choose one of: {hardware_choices()}")
        hw = HARDWARE_PRESETS[key]
    ov = {k: v for k, v in overrides.items() if v is not None}
    if "pcie_bw" in ov:
        ov["pcie_bw_override"] = ov.pop("pcie_bw")
    allowed = {"hbm_bw", "hbm_capacity", "pcie_gen", "pcie_width", "pcie_bw_override", "host_ram", "nvme_bw"}
    bad = set(ov) - allowed
    if bad:
        raise ValueError(f"unknown hardware override(s) {sorted(bad)}; allowed: {sorted(allowed)}")
    if ("pcie_gen" in ov or "pcie_width" in ov) and hw.pcie_gen is None and "pcie_gen" not in ov:
        ov["pcie_gen"] = 4
    return replace(hw, **ov) if ov else hw
