"""Options of the `cuda` platform, declared and validated by the platform itself (`CudaPlatform.Options`)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nanoplug.api.options import Bool, Float


class CudaOptions(BaseModel):
    """Options of the `cuda` platform: `EngineConfig(cuda={"enforce_eager": True})`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
    memory_utilization: Float = Field(0.9, gt=0, le=1, description="share of GPU memory the engine may use")
    enforce_eager: Bool = Field(False, description="no CUDA graphs, no fused small-op or small-batch GEMM kernels")
    compile_fused_ops: Bool = Field(True, description="one kernel for each small op (Triton; torch.compile where "
                                    "triton does not import), a Triton kernel for one- and two-row linear "
                                    "layers and one for temperature sampling; off: the plain ops, cuBLAS and the "
                                    "plain sampler, to measure without")
    require_graphs: Bool = Field(False, description="stop start-up when decode cannot be captured as CUDA graphs, "
                                 "instead of running it eager with a warning")

    @model_validator(mode="after")
    def _graphs_possible(self) -> "CudaOptions":
        if self.require_graphs and self.enforce_eager:
            raise ValueError("require_graphs=True asks for CUDA graphs, but enforce_eager=True turns them off; "
                             "drop one of the two")
        return self
