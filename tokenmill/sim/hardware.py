"""Accelerator catalog for the roofline cost model: dense tensor FLOPs per dtype, HBM size and bandwidth,
the intra-node link. Per GPU; a worker of `tp` GPUs has tp times the compute, memory and bandwidth (and pays
the all-reduces). Prices are not in the catalog: the user sets `--price-per-hour` (per GPU).

Sources (dense = without 2:4 sparsity; HGX figures divided by 8 GPUs):
  H100 SXM   NVIDIA H100 Tensor Core GPU datasheet: BF16 989 TFLOPS, FP8 1,979 (dense; the sheet's 1,979 /
             3,958 are with sparsity), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s.
  H200 SXM   NVIDIA H200 datasheet: the H100's compute, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
  B200       NVIDIA HGX B200 spec (8 GPUs: FP4 72 PF, FP8 36 PF, BF16 18 PF dense; 1.44 TB HBM3e;
             62 TB/s) -> per GPU 9 / 4.5 / 2.25 PF, 180 GB, 7.7 TB/s; NVLink 5 1.8 TB/s.
  B300       NVIDIA HGX B300 spec and glennklockwood.com/garden/processors/B300: BF16 2.25 PF, FP8 4.5 PF,
             FP4 ~13 PF dense (Blackwell Ultra raised FP4 only); 288 GB HBM3e at 8 TB/s; NVLink 5 1.8 TB/s.
These are peak numbers; the cost model's MFU / MBU factors (defaults below) say how much of them a step gets.

Host link (`host_link_bw`: pool <-> host DRAM copies, the KV tiers' installs and write-through, sim/tiers.py):
  H100 / H200 / B200 sit on PCIe Gen5 x16 (64 GB/s per direction raw, per the datasheets' "PCIe Gen5:
  128 GB/s" bidirectional); pinned cudaMemcpy reaches ~50 GB/s of it, the figure used. B300: the HGX B300
  spec lists PCIe Gen6 (via ConnectX-8); 100 GB/s assumed (~80% of Gen6 x16's 128 GB/s raw per direction).
  Grace-Hopper / Grace-Blackwell NVLink-C2C (450 GB/s per direction) is not in the catalog.
The tiers' own speeds are not the GPU's (sim/tiers.py TierIO): host tier = one thread reading a /dev/shm
file (a kernel memcpy, ~10 GB/s) plus its CRC-32 verification (~4 GB/s, measured in engine/tiers/store.py);
disk tier = one NVMe drive: PCIe 4.0 drives read ~7 GB/s and write ~5-6 GB/s sequentially, PCIe 5.0 drives
~12-14 / ~10-12 GB/s (vendor datasheets, e.g. Samsung 990 Pro / PM1743), 6 / 3 GB/s used for one reader /
writer thread of 2 MiB-ish files, with ~80 us per read (NAND read latency + a file open). All settable
(`tokenmill sim --kv-host-bw ... --kv-disk-read-bw ... --kv-link-bw ...`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.cli import CLIError

TERA = 1e12


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: dict[str, float] = field(default_factory=dict)  # dtype -> dense FLOP/s per GPU
    hbm_bytes: float = 80e9
    hbm_bw: float = 3.35e12  # bytes/s per GPU
    link_bw: float = 450e9  # bytes/s one direction per GPU (NVLink), for TP all-reduce
    link_latency_s: float = 5e-6  # per all-reduce
    source: str = ""
    host_link_bw: float = 50e9  # bytes/s one direction per GPU, device <-> host DRAM (PCIe): the KV tiers' copies

    def __post_init__(self):
        if self.hbm_bytes <= 0 or self.hbm_bw <= 0 or self.link_bw <= 0 or self.host_link_bw <= 0 or not self.flops:
            raise ValueError(f"hardware {self.name!r}: flops, hbm_bytes, hbm_bw, link_bw and host_link_bw must be > 0")

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.flops:
            raise CLIError(f"hardware {self.name} has no {dtype} tensor FLOPs in the catalog "
                           f"(it has {', '.join(self.flops)})")
        return self.flops[dtype]


CATALOG: dict[str, Hardware] = {
    "h100": Hardware("H100 SXM", {"bf16": 989 * TERA, "fp8": 1979 * TERA}, 80e9, 3.35e12, 450e9,
                     source="NVIDIA H100 Tensor Core GPU datasheet (SXM5)"),
    "h200": Hardware("H200 SXM", {"bf16": 989 * TERA, "fp8": 1979 * TERA}, 141e9, 4.8e12, 450e9,
                     source="NVIDIA H200 Tensor Core GPU datasheet"),
    "b200": Hardware("B200 (HGX)", {"bf16": 2250 * TERA, "fp8": 4500 * TERA, "fp4": 9000 * TERA}, 180e9, 7.7e12,
                     900e9, source="NVIDIA HGX B200 specifications, per GPU (8-GPU totals / 8)"),
    "b300": Hardware("B300 (HGX)", {"bf16": 2250 * TERA, "fp8": 4500 * TERA, "fp4": 13125 * TERA}, 288e9, 8.0e12,
                     900e9, source="NVIDIA HGX B300 specifications; glennklockwood.com/garden/processors/B300",
                     host_link_bw=100e9),
}


def get_hardware(name: str) -> Hardware:
    key = name.lower().replace("-", "").replace("_", "").replace("sxm", "")
    if key not in CATALOG:
        raise CLIError(f"--hardware {name!r}: not in the catalog ({', '.join(CATALOG)}) and not a profile file")
    return CATALOG[key]
