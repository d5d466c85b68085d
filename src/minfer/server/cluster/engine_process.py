"""One replica's engine: ``python -m minfer.server.cluster.engine_process`` runs :func:`minfer.server.serve`
(the single-process server, unchanged) with the :class:`~minfer.server.ServeOptions` given as JSON in
``$MINFER_REPLICA_OPTIONS`` (the environment, so the API key is not on a command line), and exits when
the process that started it (the Ray replica) is gone.

It is a process of its own, not code inside the Ray actor: the engine loop runs on its main thread, where
numba's kernels run fastest (see :meth:`~minfer.runtime.engine_loop.EngineLoop.run`), and every route,
error, key check and stream is the plain server's own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
from typing import Any

from minfer.server import ServeOptions

OPTIONS_VARIABLE = "MINFER_REPLICA_OPTIONS"
PARENT_POLL_SECONDS = 0.5


def options_to_json(opts: ServeOptions) -> str:
    return json.dumps(dataclasses.asdict(opts))


def options_from_json(text: str) -> ServeOptions:
    fields: dict[str, Any] = json.loads(text)
    for name in ("cors_origins", "api_keys"):  # tuples came back as JSON lists
        fields[name] = tuple(fields.get(name) or ())
    if fields.get("lora") is not None:  # (path, scale) pairs came back as JSON lists
        fields["lora"] = [(path, scale) for path, scale in fields["lora"]]
    return ServeOptions(**fields)


def exit_with_parent(parent: int) -> None:
    """A thread that ends this process once ``parent`` is gone (a SIGKILLed replica leaves no engine behind)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="minfer-parent-watch", daemon=True).start()


def main() -> int:
    opts = options_from_json(os.environ.pop(OPTIONS_VARIABLE))
    exit_with_parent(os.getppid())
    from minfer.errors import MinferError
    from minfer.server import serve

    try:
        serve(opts)
    except MinferError as e:  # the replica's log gets the one line the CLI would print
        print(f"minfer: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
