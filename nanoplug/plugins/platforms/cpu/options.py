"""Options of the `cpu` platform, declared and validated by the platform itself (`CpuPlatform.Options`)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nanoplug.api.options import Bool, Float


class CpuOptions(BaseModel):
    """Options of the `cpu` platform: `EngineConfig(cpu={"kernels": False})`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
    kv_cache_gb: Float = Field(4.0, gt=0, description="KV-cache memory when num_kv_blocks is None")
    kernels: Bool | None = Field(None, description="nanoplug's C++ kernels for float32 steps (decode-sized GEMM, "
                                 "RMSNorm, SiLU-and-mul, RoPE, greedy argmax), compiled once per machine; None: "
                                 "when a C++ compiler is found")
    weight_packing: Bool | None = Field(None, description="pack linear weights once for a decode-sized float32 GEMM "
                                        "(nanoplug's with the kernels, else MKL's; a second copy of them); None: "
                                        "when it fits in a quarter of the available memory")
    graphs: Bool = Field(True, description="record a decode step per batch size once and replay it (the CPU's "
                         "CUDA graphs: no Python per layer); with the kernels only; off: every step eager")
    require_graphs: Bool = Field(False, description="stop start-up when decode steps cannot be recorded, instead "
                                 "of running them eager with a warning")

    @model_validator(mode="after")
    def _graphs_possible(self) -> "CpuOptions":
        if self.require_graphs and not (self.graphs and self.kernels is not False):
            off = "graphs=False" if not self.graphs else "kernels=False (recordings need the C++ kernels)"
            raise ValueError(f"require_graphs=True asks for recorded decode steps, but {off} turns them off; "
                             "drop one of the two")
        return self
