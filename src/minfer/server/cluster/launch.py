"""``minfer serve MODEL --ray``: join (``--ray-address``) or start a Ray cluster, deploy the replicas on Ray
Serve, and serve the front (:mod:`.front`) on ``--host``/``--port`` until SIGINT/SIGTERM; then the
replicas stop (each engine finishes its open requests within ``--shutdown-timeout``) and a cluster
started here is shut down.

Several models (``minfer serve A B --ray``, ``--models-dir DIR --ray``): a Serve application of its own for
each, with ``--replicas`` (or ``--autoscale``) replicas, all loaded at start; the front routes by model first.
"""

from __future__ import annotations

import os
import sys
import threading
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from minfer.errors import BadRequestError
from minfer.server import ServeOptions, errors_to_stderr, for_model, listening_socket, with_keys
from minfer.server.api_keys import resolve_api_keys
from minfer.server.cluster.front import Front, FrontConfig
from minfer.server.cluster.prefix import POLICIES

LOCAL_OBJECT_STORE_BYTES = 128 * 1024 * 1024  # the replicas pass nothing through Ray's object store


@dataclass(frozen=True)
class RayOptions:
    replicas: int = 2
    autoscale: tuple[int, int] | None = None  # (min, max) replicas
    address: str | None = None  # an existing cluster ("auto", "ray://host:10001", "host:6379"); None: a local one
    route_policy: str = "prefix"
    queue_threshold: int = 2


def parse_autoscale(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        lo, hi = int(low), int(high)
    except ValueError:
        raise BadRequestError(f"--autoscale must be MIN:MAX replicas, e.g. 1:4, got {text!r}") from None
    if not sep or lo < 1 or hi < lo:
        raise BadRequestError(f"--autoscale must be MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def check(opts: ServeOptions, ray_opts: RayOptions) -> None:
    if ray_opts.replicas < 1:
        raise BadRequestError(f"--replicas must be >= 1, got {ray_opts.replicas}")
    if ray_opts.route_policy not in POLICIES:
        raise BadRequestError(f"--route-policy must be one of {', '.join(POLICIES)}, got {ray_opts.route_policy!r}")
    if ray_opts.queue_threshold < 0:
        raise BadRequestError(f"--route-queue-threshold must be >= 0, got {ray_opts.queue_threshold}")
    if opts.parallel < 1:
        raise BadRequestError(f"--parallel must be >= 1, got {opts.parallel}")


@dataclass(frozen=True)
class RayModel:
    """One model's group of replicas: its name (the front's, and the replicas' ``--alias`` with several), the
    file the front reads its tokenizer from, and what each replica is told to load."""

    name: str
    path: Path
    ref: str | None  # None: the default model, which a replica on a joined cluster resolves on its node
    mmproj: Path | None = None  # a --models-dir folder's vision tower GGUF, beside the model's (--mmproj)


def ray_models(opts: ServeOptions, ray_opts: RayOptions, models: list[str],
               models_dir: str | None) -> list[RayModel]:
    """The models to serve: ``opts.model`` alone, or several (as the several-model server names them). A
    replica on a joined cluster resolves a known name itself; a file's path must be the same on every node."""
    from minfer.pull import resolve_model
    from minfer.server import refuse_one_model_flags
    from minfer.server.model_router import model_entries

    if not models and models_dir is None:
        path = Path(resolve_model(opts.model))  # pulled here once; replicas on other nodes resolve the same name
        return [RayModel(opts.alias or path.name, path, str(path) if ray_opts.address is None else opts.model)]
    refuse_one_model_flags(opts)
    entries = model_entries(models, models_dir)
    if not entries:
        raise BadRequestError("no model to serve: give model files or folders, or --models-dir DIR")
    return [RayModel(e.name, e.path, str(e.path), e.mmproj) for e in entries]


def replica_scaling(ray_opts: RayOptions, parallel: int) -> dict[str, object]:
    """The deployment's replica count, or its autoscaling between ``--autoscale``'s bounds on the engines'
    own load (``parallel`` sequences each is the target)."""
    if ray_opts.autoscale is None:
        return {"num_replicas": ray_opts.replicas}
    low, high = ray_opts.autoscale
    return {"autoscaling_config": {
        "min_replicas": low, "max_replicas": high, "initial_replicas": low,
        "upscale_delay_s": 10.0, "downscale_delay_s": 120.0,
        "policy": {"policy_function": "minfer.server.cluster.autoscale:LoadPolicy",
                   "policy_kwargs": {"target": float(parallel)}}}}


def serve_ray(opts: ServeOptions, ray_opts: RayOptions, models: list[str] | None = None,
              models_dir: str | None = None) -> None:
    """See the module docstring (``models``/``models_dir``: several models, as ``serve_models`` takes them)."""
    check(opts, ray_opts)
    try:
        import ray
        from ray import serve
    except ImportError:
        raise BadRequestError("--ray needs Ray Serve: pip install 'minfer[ray]' (or pip install 'ray[serve]')") \
            from None
    import uvicorn

    from minfer.server import access_log
    from minfer.server.cluster.engine_process import options_to_json
    from minfer.server.cluster.replica import MinferReplica, Registry
    from minfer.server.cluster.routing_key import PromptKeys
    from minfer.server.http_protocols import http_protocol
    from minfer.server.middleware import CatchAll

    served = ray_models(opts, ray_opts, models or [], models_dir)
    several = len(served) > 1 or models_dir is not None
    keys = {m.name: PromptKeys.from_model(m.path) for m in served}
    most = (ray_opts.autoscale[1] if ray_opts.autoscale else ray_opts.replicas) * len(served)
    threads = opts.threads or max(1, (os.cpu_count() or 1) // most)
    api_keys = resolve_api_keys(opts.api_keys)
    # the replicas' access logs are off: the front writes one line per request, with the replica that answered
    replica_opts = {m.name: replace(for_model(opts, m.path) if several else opts, model=m.ref, threads=threads,
                                    api_keys=api_keys, log_format="off", alias=m.name if several else opts.alias,
                                    mmproj=str(m.mmproj) if m.mmproj is not None else opts.mmproj)
                    for m in served}

    sock = listening_socket(opts.host, opts.port)
    host, port = sock.getsockname()[:2]

    started_cluster = ray_opts.address is None
    if started_cluster:
        # a cluster of this machine: room for every replica's threads even when that oversubscribes the cores
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a local cluster reports nowhere
        ray.init(num_cpus=max(os.cpu_count() or 1, most * threads), include_dashboard=False,
                 object_store_memory=LOCAL_OBJECT_STORE_BYTES, namespace="minfer", configure_logging=False)
    else:
        ray.init(address=ray_opts.address, namespace="minfer", configure_logging=False)
    run = uuid.uuid4().hex[:8]
    registry = Registry(run)
    # one application per model (each its own deployment, replicas and autoscaling)
    app_names = {m.name: f"minfer-{run}" + (f"-{i}" if several else "") for i, m in enumerate(served)}
    try:
        serve.start(proxy_location="Disabled")  # the front is the only HTTP entry: no Serve proxy
        deployment = serve.deployment(
            MinferReplica, name="engine", ray_actor_options={"num_cpus": threads},
            health_check_period_s=2.0, health_check_timeout_s=30.0,
            graceful_shutdown_timeout_s=opts.shutdown_timeout + 10.0, **replica_scaling(ray_opts, opts.parallel))
        # a local cluster's engines listen on loopback only; a real cluster's on their node's address
        host_ip = "127.0.0.1" if started_cluster else None
        targets = [serve.RunTarget(deployment.bind(run, options_to_json(replica_opts[name]), host_ip, name),
                                   name=app, route_prefix=None) for name, app in app_names.items()]
        deployed = threading.Thread(target=_deploy, args=(serve, targets), name="minfer-deploy", daemon=True)
        deployed.start()  # the front answers /health (replicas starting) while they load

        config = FrontConfig(api_keys=api_keys, max_body_size=opts.max_body_size, policy=ray_opts.route_policy,
                             queue_threshold=ray_opts.queue_threshold, log_format=opts.log_format)
        access_log.configure(opts.log_format)
        front = Front(config, registry.entries, registry.forget, keys)
        errors_to_stderr()
        server = uvicorn.Server(uvicorn.Config(CatchAll(front), log_level=opts.log_level, access_log=False,
                                               http=http_protocol(), lifespan="on",
                                               timeout_graceful_shutdown=opts.shutdown_timeout + 2.0))
        how = (f"{ray_opts.autoscale[0]}..{ray_opts.autoscale[1]} replicas" if ray_opts.autoscale
               else f"{ray_opts.replicas} replicas") + (" of each" if several else "")
        where = "a local Ray cluster" if started_cluster else f"the Ray cluster at {ray_opts.address}"
        print(f"minfer: serving {', '.join(keys)} on http://{host}:{port} ({how} on {where}, "
              f"{threads} threads and {opts.parallel} parallel sequences each, {ray_opts.route_policy} routing)"
              f"{with_keys(api_keys)}", file=sys.stderr, flush=True)
        server.run(sockets=[sock])  # until SIGINT/SIGTERM (uvicorn's handlers, on this main thread)
    finally:
        try:
            for app in app_names.values():
                serve.delete(app)  # each engine gets its --shutdown-timeout for open requests
            registry.clear()
            if started_cluster:
                serve.shutdown()
        finally:
            ray.shutdown()


def _deploy(serve: object, targets: list[object]) -> None:
    try:
        serve.run_many(targets)  # type: ignore[attr-defined]  # every model's replicas start together
    except Exception as e:  # noqa: BLE001 - the front's /health shows it; the log says why
        print(f"minfer: deploying the replicas failed: {e}", file=sys.stderr, flush=True)
