"""The GPUs a plan can be timed for: dense peaks, memory and host-link bandwidth, with their sources.
No torch import: the CLI lists them in its help."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_GPU", "GPU", "gpu", "GPUS"]


@dataclass(frozen=True)
class GPU:
    """Dense peaks (FLOP/s) by dtype, memory and host-link bandwidth (bytes/s), and where they come from."""

    name: str
    bf16: float
    fp32: float
    memory_bandwidth: float
    host_link: float  # one direction of the host link (PCIe), bytes/s
    source: str

    def peak(self, dtype) -> float:
        """The dense peak for a torch dtype: 16-bit floats on the bf16 tensor cores, anything else at fp32 (TF32)."""
        return self.bf16 if str(dtype) in ("torch.bfloat16", "torch.float16") else self.fp32


#: The GPUs a plan can name. Dense tensor-core peaks (the datasheets print bf16 with sparsity, twice these), fp32 as
#: TF32 tensor-core dense, HBM/GDDR bandwidth, and PCIe x16 per direction (Gen5 64 GB/s, Gen4 32 GB/s).
GPUS = {
    "h100": GPU("NVIDIA H100 SXM5 80GB", 989e12, 494e12, 3.35e12, 64e9, "NVIDIA H100 datasheet (SXM5); PCIe Gen5 x16"),
    "h200": GPU("NVIDIA H200 SXM 141GB", 989e12, 494e12, 4.8e12, 64e9, "NVIDIA H200 datasheet (SXM); PCIe Gen5 x16"),
    "a100": GPU("NVIDIA A100 SXM4 80GB", 312e12, 156e12, 2.039e12, 32e9,
                "NVIDIA A100 datasheet (SXM4 80GB); PCIe Gen4 x16"),
    "rtx4090": GPU("NVIDIA GeForce RTX 4090", 165.2e12, 82.6e12, 1.008e12, 32e9,
                   "NVIDIA Ada Lovelace architecture whitepaper (bf16 with fp32 accumulate); PCIe Gen4 x16"),
}


#: The GPU a plan's moves are weighed on when ``--budget`` is given without ``--gpu`` (the report's header names it).
DEFAULT_GPU = "h100"


def gpu(name: str) -> GPU:
    """A GPU of :data:`GPUS` by name (case-insensitive), with the list in the error."""
    key = name.strip().lower().replace(" ", "").replace("-", "")
    if key not in GPUS:
        raise ValueError(f"--gpu {name!r}: expected one of {', '.join(GPUS)}")
    return GPUS[key]
