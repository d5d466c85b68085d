"""The Ray front against the plain server on this machine: ``bench/server_load.py`` for each setup, the
setups interleaved round by round (a shared machine drifts), then each setup's median token rate per
concurrency and its ratio to the plain server's in the same round.

    PYTHONPATH=src python3 bench/ray_scaling.py [--rounds 2] [--clients 1,4,8] [--requests 4] [--max-tokens 32]

Setups: the plain server with 1 thread and with 2, and ``--ray`` with 1 and 2 replicas of 1 thread each
(every setup has --parallel 8 sequences per engine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETUPS = {
    "plain 1 thread": "--threads 1",
    "plain 2 threads": "--threads 2",
    "ray 1 replica x 1 thread": "--ray --replicas 1 --threads 1 --log-format off",
    "ray 2 replicas x 1 thread": "--ray --replicas 2 --threads 1 --log-format off",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    rates: dict[str, list[dict[int, float]]] = {name: [] for name in SETUPS}
    for k in range(args.rounds):
        for name, flags in SETUPS.items():
            cmd = [sys.executable, str(HERE / "server_load.py"), "--clients", args.clients, "--requests",
                   str(args.requests), "--max-tokens", str(args.max_tokens), "--repeat", "1", "--long-run", "0",
                   "--server-args", flags, "--json"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                raise SystemExit(f"{name}: server_load.py failed:\n{done.stderr[-3000:]}")
            report = json.loads(done.stdout[done.stdout.index("{"):])
            row = {r["clients"]: r["tokens_per_s"] for r in report["runs"]}
            failed = sum(r["failed"] for r in report["runs"])
            rates[name].append(row)
            print(f"round {k + 1}: {name}: " + ", ".join(f"{c} clients {v:.1f} tok/s" for c, v in row.items())
                  + f"; failed {failed}", flush=True)
    clients = [int(c) for c in args.clients.split(",")]
    base = "plain 1 thread"
    print("\nmedian tokens/s (ratio to the plain 1-thread server, per round, median):")
    for name in SETUPS:
        cells = []
        for c in clients:
            med = statistics.median(r[c] for r in rates[name])
            ratio = statistics.median(r[c] / b[c] for r, b in zip(rates[name], rates[base], strict=True))
            cells.append(f"{c} clients {med:.1f} ({ratio:.2f}x)")
        print(f"  {name}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
