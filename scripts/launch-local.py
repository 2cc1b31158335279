#!/usr/bin/env python3
"""Starts N copies of a command on this machine the way torchrun starts them: each with
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1 and MASTER_PORT (a free port) set.

    scripts/launch-local.py -n 4 -- nnscaler-rt train bundle/

It is the stand-in for torchrun where torchrun is missing or broken (Debian's torch 1.13
torchrun fails under Python 3.11 in its elastic agent): it waits for every process and
exits with the first failing rank's status, printing which ranks failed. Each process's
output goes to this one's, unchanged; with --logs DIR, rank R's to DIR/rank-R.log
instead. --kill R@SECONDS kills rank R (SIGKILL) that many seconds after the start, to
see how the others end; with --kill-after FILE the seconds count from when FILE exists
and is not empty (e.g. the run's log: the ranks have met and are training), so that the
kill lands mid-run on a slow machine as on a fast one."""

import argparse
import os
import signal
import socket
import subprocess
import sys
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--nproc", type=int, required=True, help="processes to start")
    ap.add_argument("--port", type=int, default=0, help="MASTER_PORT (default: a free one)")
    ap.add_argument("--logs", help="write rank R's output to DIR/rank-R.log")
    ap.add_argument("--kill", help="R@SECONDS: kill rank R after SECONDS")
    ap.add_argument("--kill-after", metavar="FILE",
                    help="count --kill's seconds from when FILE exists and is not empty")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd or a.nproc < 1:
        ap.error("give -n N and a command after --")
    if a.kill_after and not a.kill:
        ap.error("--kill-after applies to --kill R@SECONDS")
    port = a.port or free_port()
    if a.logs:
        os.makedirs(a.logs, exist_ok=True)
    procs = []
    for r in range(a.nproc):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(a.nproc), LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        out = open(os.path.join(a.logs, f"rank-{r}.log"), "w") if a.logs else None
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None))
    kill = None
    if a.kill:
        r, s = a.kill.split("@")
        kill = [int(r), float(s), None if a.kill_after else time.time() + float(s)]
    codes = [None] * a.nproc
    while any(c is None for c in codes):
        for r, p in enumerate(procs):
            if codes[r] is None:
                codes[r] = p.poll()
        if kill and kill[2] is None and os.path.exists(a.kill_after) \
                and os.path.getsize(a.kill_after) > 0:
            kill[2] = time.time() + kill[1]
        if kill and kill[2] is not None and time.time() >= kill[2] and codes[kill[0]] is None:
            procs[kill[0]].send_signal(signal.SIGKILL)
            print(f"launch-local: killed rank {kill[0]}", file=sys.stderr, flush=True)
            kill = None
        time.sleep(0.05)
    failed = [(r, c) for r, c in enumerate(codes) if c != 0]
    if failed:
        print("launch-local: failed: " + ", ".join(f"rank {r} (exit {c})" for r, c in failed),
              file=sys.stderr)
        c = failed[0][1]
        sys.exit(c if 0 < c < 256 else 1)


if __name__ == "__main__":
    main()
