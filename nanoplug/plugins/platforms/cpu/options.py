"""Options of the `cpu` platform, declared and validated by the platform itself (`CpuPlatform.Options`)."""
from __future__ import annotations

from typing import Literal

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
                                        "when it measured faster on this CPU (once, cached) and fits in a quarter "
                                        "of the available memory")
    gguf_activations: Literal["auto", "float", "int8x2", "int8"] = Field(
        "auto", description="how a GGUF model's activations meet its blocks: float (float32), int8x2 (int8 blocks of "
        "x and of its residual: float32's quality), int8 (llama.cpp's: faster, visibly worse answers); auto: float "
        "or int8x2 by rows, as measured faster on this CPU (once, cached)")
    graphs: Bool = Field(True, description="record a decode step per batch size once and replay it (the CPU's "
                         "CUDA graphs: no Python per layer); with the kernels only; off: every step eager")
    record_ahead: Bool = Field(False, description="record every batch size's decode step at start-up (a few seconds) "
                               "instead of each when a step first needs it (always ahead under tensor parallelism)")
    require_graphs: Bool = Field(False, description="stop start-up when decode steps cannot be recorded, instead "
                                 "of running them eager with a warning")

    @model_validator(mode="after")
    def _graphs_possible(self) -> "CpuOptions":
        if self.require_graphs and not (self.graphs and self.kernels is not False):
            off = "graphs=False" if not self.graphs else "kernels=False (recordings need the C++ kernels)"
            raise ValueError(f"require_graphs=True asks for recorded decode steps, but {off} turns them off; "
                             "drop one of the two")
        return self
