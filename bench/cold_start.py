"""Cold and warm start of ``minfer run``, whole process, as a new user meets them.

    python bench/cold_start.py                      # 2 cold runs, 5 warm runs of the default model
    python bench/cold_start.py --cold 3 --warm 5 --src /path/to/other/checkout/src   # another version

Cold: each run gets a new empty ``NUMBA_CACHE_DIR`` (nothing compiled). Warm: one shared cache, filled by
an uncounted first run. Per run: seconds to the first line on stderr (the compile notice on a cold run), to
the first generated text on stdout (the first answer), to exit, and CPU seconds (user + system of the run
and the processes it waited for: a compile worker's included). Medians are printed with the load average
before and after: on a shared machine wall times grow with the load, CPU times much less.
"""

from __future__ import annotations

import argparse
import os
import resource
import selectors
import statistics
import subprocess
import sys
import tempfile
import time


def one_run(cmd: list[str], env: dict[str, str]) -> dict[str, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    sel = selectors.DefaultSelector()
    assert proc.stdout is not None and proc.stderr is not None
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    first: dict[str, float] = {}
    err = b""
    open_streams = 2
    while open_streams:
        for key, _ in sel.select():
            data = os.read(key.fileobj.fileno(), 65536)  # type: ignore[union-attr]
            if not data:
                sel.unregister(key.fileobj)
                open_streams -= 1
                continue
            if key.data == "err":
                err += data
            if data.strip():
                first.setdefault(key.data, time.monotonic() - t0)
    proc.wait()
    end = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}): {err.decode(errors='replace')[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"stderr": first.get("err", float("nan")), "answer": first.get("out", float("nan")), "exit": end,
            "cpu": cpu, "compiled": float(b"compiling" in err)}


def report(name: str, runs: list[dict[str, float]]) -> None:
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"{name:5s} n={len(runs)}  first stderr line {med['stderr']:6.1f} s   first answer {med['answer']:6.1f} s   "
          f"exit {med['exit']:6.1f} s   cpu {med['cpu']:6.1f} s   "
          f"(runs that compiled: {sum(r['compiled'] for r in runs):.0f})")
    for r in runs:
        print(f"        stderr {r['stderr']:6.1f}  answer {r['answer']:6.1f}  "
              f"exit {r['exit']:6.1f}  cpu {r['cpu']:6.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cold", type=int, default=2)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--src", default=None, help="the minfer source folder to run (default: the installed one)")
    ap.add_argument("--model", default=None, help="model (default: minfer's default model)")
    ap.add_argument("-n", type=int, default=8, help="tokens to generate (default 8)")
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "minfer", "run", *([args.model] if args.model else []), "-n", str(args.n), "Hello"]
    env = dict(os.environ)
    if args.src:
        env["PYTHONPATH"] = args.src
    print(f"load average before: {open('/proc/loadavg').read().strip()}")
    cold = []
    for _ in range(args.cold):
        with tempfile.TemporaryDirectory(prefix="minfer-cold-") as d:
            cold.append(one_run(cmd, dict(env, NUMBA_CACHE_DIR=d)))
    if cold:
        report("cold", cold)
    if args.warm:
        with tempfile.TemporaryDirectory(prefix="minfer-warm-") as d:
            warm_env = dict(env, NUMBA_CACHE_DIR=d)
            one_run(cmd, warm_env)  # fills the cache, not counted
            report("warm", [one_run([*cmd[:-3], "-n", "1", "Hello"], warm_env) for _ in range(args.warm)])
    print(f"load average after: {open('/proc/loadavg').read().strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
