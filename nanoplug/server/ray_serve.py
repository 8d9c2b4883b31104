"""nanoplug on Ray Serve: each Serve replica one engine with nanoplug's own OpenAI app as its ASGI ingress.

Ray Serve places the replicas on the cluster's nodes (one GPU each with `num_gpus=1`), routes HTTP requests
among them (power of two choices on their ongoing requests), replaces a replica that dies, and scales their
number between `min_replicas` and `max_replicas` so that each holds about `target_ongoing_requests`: the
queue length a nanoplug engine reports as waiting plus running. Imported only by `serve run` and the test
(`ray[serve]` is not a dependency of nanoplug itself).

    serve run nanoplug.server.ray_serve:build model=/models/Qwen3-0.6B max_replicas=4 num_gpus=1

`build(args)` takes the `serve run` key=value arguments (all strings): `model` (required), `name` (the
served model name), `num_replicas` (fixed; else autoscaling from `min_replicas`, default 1, to
`max_replicas`, default 2, at `target_ongoing_requests`, default 16, after `upscale_delay_s` (5) or
`downscale_delay_s` (60); `look_back_period_s` as Serve has it), `num_cpus` and `num_gpus` per replica, and any
EngineConfig field (`max_model_len=4096`, `kv_block_size=16`, ...), validated by EngineConfig.
Each response carries `x-nanoplug-replica`, the Serve replica that answered. docs/serving.md has the recipe.
"""
from __future__ import annotations

import json
import os
from typing import Any

from ray import serve

AUTOSCALING_KEYS = {"upscale_delay_s", "downscale_delay_s", "look_back_period_s"}
SERVE_KEYS = {"name", "num_replicas", "min_replicas", "max_replicas", "target_ongoing_requests", "num_cpus",
              "num_gpus", "api_key"} | AUTOSCALING_KEYS


class NanoplugReplica:
    """One Serve replica: an engine core stepped in this actor's process (engine_loop.py) behind build_app."""

    def __init__(self, engine_options: dict[str, Any], model_name: str, api_key: str | None = None):
        from nanoplug.config import EngineConfig
        from nanoplug.server.engine_loop import EngineLoop

        self.engine = EngineLoop(EngineConfig(**engine_options))
        self.model_name, self.api_key = model_name, api_key

    def __serve_build_asgi_app__(self):
        from nanoplug.server.app import ServerSettings, build_app

        app = build_app(self.engine, ServerSettings(model_name=self.model_name, api_key=self.api_key))
        replica = serve.get_replica_context().replica_id.unique_id

        @app.middleware("http")
        async def name_the_replica(request, call_next):
            response = await call_next(request)
            response.headers["x-nanoplug-replica"] = replica
            return response

        return app

    def __del__(self):
        self.engine.stop()


def deployment(num_replicas: int | None = None, min_replicas: int = 1, max_replicas: int = 2,
               target_ongoing_requests: float = 16, num_cpus: float = 1, num_gpus: float = 0,
               upscale_delay_s: float = 5, downscale_delay_s: float = 60, **autoscaling: float):
    """The Serve deployment: a fixed `num_replicas`, or autoscaling on each replica's ongoing requests
    (`autoscaling`: Serve's look_back_period_s, where its default will not do; how often replicas report is
    Serve's RAY_SERVE_*_AUTOSCALING_METRIC_PUSH_INTERVAL_S environment)."""
    options: dict[str, Any] = {"ray_actor_options": {"num_cpus": num_cpus, "num_gpus": num_gpus},
                               "max_ongoing_requests": max(int(target_ongoing_requests) * 4, 64),
                               "health_check_period_s": 2, "health_check_timeout_s": 30}
    if num_replicas is not None:
        options["num_replicas"] = num_replicas
    else:
        options["autoscaling_config"] = {"min_replicas": min_replicas, "max_replicas": max_replicas,
                                         "target_ongoing_requests": target_ongoing_requests,
                                         "upscale_delay_s": upscale_delay_s, "downscale_delay_s": downscale_delay_s,
                                         **autoscaling}
    return serve.deployment(serve.ingress()(NanoplugReplica), name="nanoplug", **options)


def build(args: dict[str, str]):
    """`serve run nanoplug.server.ray_serve:build model=DIR [key=value ...]` (see the module's docstring)."""
    args = dict(args)
    if "model" not in args:
        raise ValueError("serve run nanoplug.server.ray_serve:build needs model=DIR (a checkpoint folder or a Hub id)")
    serve_args = {k: args.pop(k) for k in list(args) if k in SERVE_KEYS}
    name = serve_args.pop("name", None) or args["model"]
    api_key = serve_args.pop("api_key", None) or os.environ.get("NANOPLUG_API_KEY")
    numbers = {k: (int(v) if k.endswith("replicas") else float(v)) for k, v in serve_args.items()}
    return deployment(**numbers).bind({k: _value(v) for k, v in args.items()}, name, api_key)


def _value(text: Any) -> Any:
    """A `serve run` argument as JSON where it is JSON (4096, true, {"kernels": false}), else the string."""
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text
