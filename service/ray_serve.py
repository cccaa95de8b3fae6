"""`python -m service.ray_serve`: the same server, as N Ray Serve replicas behind Serve's HTTP proxy.

Each replica builds the service's own app (`app.create_app`: routes, schemas, batcher, runtime)
and loads the artifacts itself, so every replica has its own VMs; Serve's proxy spreads requests
over them and its autoscaler adds or removes replicas. Settings come from configs/ray_serve.yaml
(validated here), overridden by flags; `--replicas N` fixes the count and turns autoscaling off.
Every response carries `x-replica` (the Serve replica id), so a client can tell who answered.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import ray
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from ray import serve
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from artifact.errors import ArtifactError
from artifact.levels import artifact_for_this_cpu
from compile.config import read_yaml_mapping, validation_problems

from .settings import Settings

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "ray_serve.yaml"
APP_NAME = "bert"


class ConfigError(ValueError):
    """configs/ray_serve.yaml (or a flag) is missing, malformed or out of range."""


class Autoscaling(BaseModel):
    """Serve's autoscaling_config: replicas are added when requests in flight per replica exceed the target."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(8, gt=0)
    upscale_delay_s: float = Field(10, ge=0)
    downscale_delay_s: float = Field(300, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> "Autoscaling":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        return self


class ActorOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_cpus: float = Field(1, gt=0, description="CPUs Ray reserves per replica (fractions let several share one)")


class Http(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)


class RayServeConfig(BaseModel):
    """Everything the deployment needs besides the artifacts; every field can come from YAML."""

    model_config = ConfigDict(extra="forbid")

    replicas: int | None = Field(None, ge=1, description="fixed replica count; when set, autoscaling is off")
    autoscaling: Autoscaling = Field(default_factory=Autoscaling)
    max_ongoing_requests: int = Field(32, ge=1, description="requests one replica takes at once")
    ray_actor_options: ActorOptions = Field(default_factory=ActorOptions)
    http: Http = Field(default_factory=Http)
    server: dict[str, Any] = Field(default_factory=dict, description="service Settings fields for every replica")

    def deployment_options(self) -> dict[str, Any]:
        """Keyword arguments for `Deployment.options`."""
        scaling = ({"num_replicas": self.replicas} if self.replicas is not None
                   else {"autoscaling_config": self.autoscaling.model_dump()})
        return {**scaling, "max_ongoing_requests": self.max_ongoing_requests,
                "ray_actor_options": self.ray_actor_options.model_dump()}


def load_config(path: Path | None, overrides: dict[str, Any]) -> RayServeConfig:
    """Merge a YAML file (default: configs/ray_serve.yaml when present) with flag overrides.

    Overrides are dotted keys (`http.port`, `ray_actor_options.num_cpus`); None means "not given".
    """
    data: dict[str, Any] = {}
    if path is None and DEFAULT_CONFIG.is_file():
        path = DEFAULT_CONFIG
    if path is not None:
        data = read_yaml_mapping(path, ConfigError)
    for key, value in overrides.items():
        if value is None:
            continue
        *parents, leaf = key.split(".")
        section = data
        for parent in parents:
            section = section.setdefault(parent, {})
            if not isinstance(section, dict):
                raise ConfigError(f"config key {parent} must hold a mapping of keys")
        section[leaf] = value
    try:
        return RayServeConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid configuration: {validation_problems(exc)}") from None


class ReplicaHeaderMiddleware:
    """Adds `x-replica: <replica id>` to every response, so clients see which replica answered."""

    def __init__(self, app: ASGIApp, replica: str):
        self.app, self.header = app, (b"x-replica", replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_replica(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_replica)


@serve.deployment(name="BertServer")
@serve.ingress()
class BertServer:
    """One replica: the service's app, built in the replica so its artifacts load there."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.runtime = None

    def __serve_build_asgi_app__(self) -> ASGIApp:
        from .app import create_app  # tvm and the backends load in the replica, not in the driver

        app = create_app(self.settings)
        app.add_middleware(ReplicaHeaderMiddleware, replica=serve.get_replica_context().replica_tag)
        self.runtime = app.state.runtime
        return app

    async def check_health(self) -> None:
        """Serve's probe. Its first call, before the replica takes traffic, waits for loading and
        warm-up (the app's lifespan runs them in the background), so no request sees a 503
        "loading"; a failed load, or a batcher that gave up, makes the replica unhealthy, and
        Serve replaces it."""
        while not self.runtime.ready:
            if self.runtime.failure:
                raise RuntimeError(f"cannot serve: {self.runtime.failure}")
            await asyncio.sleep(0.05)


def deploy(settings: Settings, config: RayServeConfig) -> str:
    """Start Serve's HTTP proxy and the replicas on the connected Ray cluster; returns the base URL
    once every replica has loaded and warmed up."""
    serve.start(http_options={"host": config.http.host, "port": config.http.port})
    serve.run(BertServer.options(**config.deployment_options()).bind(settings), name=APP_NAME, route_prefix="/")
    return f"http://{config.http.host}:{config.http.port}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m service.ray_serve",
        description="Serve compiled BERT artifacts from Ray Serve replicas behind its HTTP proxy.",
        epilog="Other server settings: the config's `server:` section, which overrides BERT_SERVE_* variables.",
    )
    add = parser.add_argument
    add("--artifacts", action="append", type=Path, required=True,
        help="artifact directory; give twice to serve an embed and a classify artifact")
    add("--config", type=Path, help=f"deployment settings (default {DEFAULT_CONFIG} when present)")
    add("--replicas", type=int, help="fixed number of replicas; turns autoscaling off")
    add("--num-cpus", type=float, help="CPUs reserved per replica (ray_actor_options.num_cpus)")
    add("--host", help="address of Serve's HTTP proxy (default 127.0.0.1)")
    add("--port", type=int, help="port of Serve's HTTP proxy (default 8000)")
    add("--workers", type=int, help="inference threads per model in each replica")
    add("--address", default="local",
        help="Ray cluster to join: 'local' (default) starts one here, 'auto' or HOST:PORT joins one")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config, {"replicas": args.replicas, "ray_actor_options.num_cpus": args.num_cpus,
                                           "http.host": args.host, "http.port": args.port})
        # each replica uses the CPUs Ray reserves for it, not every core of the node it lands on
        flags = {"artifacts": args.artifacts, "workers": args.workers,
                 "cores": max(1, math.floor(config.ray_actor_options.num_cpus))}
        settings = Settings.load({"cores": flags.pop("cores"), **config.server,
                                  **{k: v for k, v in flags.items() if v is not None}})
        for directory in settings.artifacts:  # a wrong directory or CPU fails here, before Ray starts N replicas
            artifact_for_this_cpu(directory, runs_code=settings.backend == "tvm")
    except (ConfigError, ArtifactError) as exc:
        print(f"ray_serve: error: {exc}", file=sys.stderr)
        return 2
    except ValidationError as exc:
        print(f"ray_serve: error: server settings: {validation_problems(exc)}", file=sys.stderr)
        return 2

    stop = threading.Event()
    ray.init(address=args.address)
    try:
        url = deploy(settings, config)
        for stop_signal in (signal.SIGINT, signal.SIGTERM):
            signal.signal(stop_signal, lambda *_: stop.set())
        print(f"serving on {url}", file=sys.stderr, flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
