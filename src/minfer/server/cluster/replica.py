"""A replica on Ray Serve: a deployment whose every replica keeps one ``minfer serve`` engine process
(:mod:`.engine_process`) on its node, and whose entry in Ray's key-value store (:class:`Registry`) tells
the front where that engine listens, its pid and its state.

Ray Serve places the replicas (``num_cpus`` = the engine's threads), health-checks them
(:meth:`MinferReplica.check_health`) and starts a new one when one dies: when the engine process exits,
the replica's watcher ends the replica's own process, so Ray sees the death at once and replaces it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any

import httpx
import ray
from ray import serve
from ray.experimental import internal_kv

from minfer.server.cluster.engine_process import OPTIONS_VARIABLE, options_from_json, options_to_json

KV_NAMESPACE = "minfer"
BEAT_SECONDS = 1.0
STARTUP_TIMEOUT = 900.0  # a first start compiles the kernels (minutes on a busy machine)


class Registry:
    """The replicas of one front (``run``), in Ray's internal key-value store (kept by the GCS, visible from
    every node)."""

    def __init__(self, run: str) -> None:
        self.prefix = f"replicas/{run}/"

    def put(self, entry: dict[str, Any]) -> None:
        internal_kv._internal_kv_put(self.prefix + entry["id"], json.dumps(entry), overwrite=True,
                                     namespace=KV_NAMESPACE)

    def entries(self) -> list[dict[str, Any]]:
        out = []
        for key in internal_kv._internal_kv_list(self.prefix, namespace=KV_NAMESPACE):
            raw = internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)
            if raw:
                out.append(json.loads(raw))
        return out

    def forget(self, replica: str) -> None:
        internal_kv._internal_kv_del(self.prefix + replica, namespace=KV_NAMESPACE)

    def clear(self) -> None:
        for key in internal_kv._internal_kv_list(self.prefix, namespace=KV_NAMESPACE):
            internal_kv._internal_kv_del(key, namespace=KV_NAMESPACE)


class MinferReplica:
    """One replica: starts the engine process and reports it (the deployment's class; see the module)."""

    def __init__(self, run: str, options_json: str, host: str | None = None, model: str = "") -> None:
        """``host``: the address the engine listens on (None: this node's address, which the front reaches);
        ``model``: the name of the model it serves (the front's group for it)."""
        self.id = serve.get_replica_context().replica_id.unique_id
        self.registry = Registry(run)
        node = host or ray.util.get_node_ip_address()
        opts = dataclasses.replace(options_from_json(options_json), host=node, port=0)
        self.entry: dict[str, Any] = {"id": self.id, "model": model, "pid": None, "actor_pid": os.getpid(), "url": None,
                                      "node": node, "slots": opts.parallel, "state": "starting", "beat": time.time()}
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._beat()
        threading.Thread(target=self._beats, name="minfer-replica-beat", daemon=True).start()
        env = {**os.environ, OPTIONS_VARIABLE: options_to_json(opts)}
        self.proc = subprocess.Popen([sys.executable, "-m", "minfer.server.cluster.engine_process"], env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.url = self._wait_for_url()
        self.client = httpx.Client(timeout=5.0)
        with self._lock:
            self.entry.update(pid=self.proc.pid, url=self.url, state="ready")
        self._beat()
        threading.Thread(target=self._watch, name="minfer-replica-watch", daemon=True).start()

    def _wait_for_url(self) -> str:
        """The engine's URL from its 'serving ... on http://...' line; its log goes on to the replica's stderr."""
        assert self.proc.stderr is not None
        tail: deque[str] = deque(maxlen=40)
        found: list[str] = []
        ready = threading.Event()

        def drain() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                sys.stderr.write(line)
                tail.append(line)
                m = re.search(r" on (http://\S+) ", line)
                if m and not found:
                    found.append(m.group(1))
                    ready.set()
            ready.set()

        threading.Thread(target=drain, name="minfer-replica-log", daemon=True).start()
        if not ready.wait(STARTUP_TIMEOUT) or not found:
            self.proc.kill()
            raise RuntimeError("the minfer engine did not start:\n" + "".join(tail))
        return found[0]

    def _beat(self) -> None:
        with self._lock:
            self.entry["beat"] = time.time()
            entry = dict(self.entry)
        self.registry.put(entry)

    def _beats(self) -> None:
        while not self._stopping.wait(BEAT_SECONDS):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the GCS restarting: the next beat tries again
                pass

    def _watch(self) -> None:
        code = self.proc.wait()
        if self._stopping.is_set():
            return
        with self._lock:
            self.entry["state"] = "dead"
        try:
            self._beat()
        finally:
            print(f"minfer: the engine process {self.proc.pid} exited ({code}); replica {self.id} ends so that "
                  "Ray Serve starts another", file=sys.stderr, flush=True)
            os._exit(1)

    def check_health(self) -> None:
        """Ray Serve's health check: the engine process is alive and answers."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"the engine process exited with {self.proc.returncode}")
        try:
            self.client.get(self.url + "/health").raise_for_status()
        except httpx.TimeoutException:
            pass  # busy, not dead: a replica is never killed for answering slowly under load

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The load Serve's autoscaler sees (requests reach the engine directly, not through Serve)."""
        health = self.client.get(self.url + "/health").json()
        return {"minfer_load": float(health.get("slots_running", 0) + health.get("slots_waiting", 0))}

    def info(self) -> dict[str, Any]:
        with self._lock:
            return dict(self.entry)

    def __del__(self) -> None:
        """Serve's graceful stop: the engine finishes what it has (its own --shutdown-timeout), then goes."""
        self._stopping.set()
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        registry = getattr(self, "registry", None)
        if registry is not None:
            try:
                registry.forget(self.id)
            except Exception:  # noqa: BLE001 - the cluster may be going down with us
                pass
