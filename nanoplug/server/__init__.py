"""`nanoplug serve`: the OpenAI-compatible HTTP server on FastAPI + uvicorn.

app.py       the app: routes, API key, the bounded queue (503), /health, /metrics, the chat page
api.py       /v1/completions and /v1/chat/completions: JSON bodies and SSE streams
guard.py     the API key and the body size, before the body is read    http.py  header deadline and size
checks.py    the front end's checks of a parsed request (both layouts), 400s naming the field
protocol.py  the request bodies (pydantic)     sampling.py  request -> SamplingParams, or a 400
prepare.py   chat template, tokenizing and context checks, beside the event loop
streams.py   one request's updates, coalesced per read     render.py    response bodies and chunks
engine_process.py  the engine core in a process of its own (the default), msgpack over a socket pair
engine_loop.py  the engine core in this process (--single-process); both layouts step it with
             nanoplug.engine.driver, as LLM does
metrics.py   Prometheus metrics (nanoplug's, and the gateway's under vLLM's names)
launch.py    uvicorn on our own socket, clean shutdown on signals
lora_routes.py  /v1/load_lora_adapter and /v1/unload_lora_adapter (--allow-runtime-lora)
replicas.py  --data-parallel-size: engine processes behind one front end, prefix-affinity dispatch
ray_serve.py a Ray Serve deployment (`serve run nanoplug.server.ray_serve:build ...`), imported only there
"""
