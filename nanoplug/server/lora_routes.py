"""`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`: vLLM's routes and bodies (`lora_name`,
`lora_path`), opt-in as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING is (ours: `--allow-runtime-lora`).

The adapter goes into a free per-request slot of every engine (each data-parallel replica), between two
of its steps: running requests lose nothing, and a folder that does not fit is a 400 naming the problem
with nothing changed. Once loaded, requests pick it by `model` and /v1/models lists it with its parent.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from nanoplug.errors import NanoplugError
from nanoplug.server.api import _parse
from nanoplug.server.errors import APIError, bad_request


class LoadLoraRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's body has it; the name decides


def add_routes(app: FastAPI, state) -> None:
    def allowed() -> None:
        if not state.settings.allow_runtime_lora:
            raise APIError(403, "loading and unloading LoRA adapters at run time is off on this server; start it "
                           "with --allow-runtime-lora (as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
                           code="runtime_lora_disabled")

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request):
        allowed()
        body = _parse(LoadLoraRequest, await request.body())
        name = body.lora_name
        if name == state.settings.model_name or name in state.adapters:
            raise bad_request(f"the model name {name!r} is served already; unload it first or pick another name",
                              param="lora_name", code="lora_name_in_use")
        async with state.adapter_lock:  # one change at a time, so the replicas agree
            try:
                await state.engine.load_adapter(name, body.lora_path)
            except NanoplugError as exc:  # a folder that is not an adapter of this model, no free slot
                raise bad_request(f"cannot load LoRA adapter {name!r}: {exc}", param="lora_path",
                                  code="invalid_lora_adapter") from exc
            state.adapters[name] = body.lora_path
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request):
        allowed()
        body = _parse(UnloadLoraRequest, await request.body())
        name = body.lora_name
        if name not in state.adapters:
            served = ", ".join(map(repr, state.adapters)) or "none"
            raise APIError(404, f"no LoRA adapter named {name!r} is loaded (loaded: {served})", param="lora_name",
                           type="not_found_error", code="lora_not_found")
        async with state.adapter_lock:
            state.adapters.pop(name)  # new requests for it are refused from now on; running ones finish with it
            await state.engine.unload_adapter(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

