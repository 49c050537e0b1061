"""``microvllm bench hostile``: every set of hostile clients, or the one ``--set`` names.

    python -m microvllm bench hostile [--model FOLDER] [--quick] [--set all|server|pd|events-tier|proxy]

    server        one server's hostile requests (bench/hostile.py)
    pd            a client of a prefill/decode pair (bench/hostile_pd.py)
    events-tier   the KV event sockets and the file-backed KV tier (bench/hostile_events_tier.py)
    proxy         the course's HTTP proxy in front of two replicas (bench/hostile_proxy.py)

Each set starts servers of its own on 127.0.0.1 and prints its table; every set after the
first ends with a verdict: no poisoned answer, no server death, memory within 10 % of its
start, a concurrent stream's largest gap under 1 s. Run it with nothing else running.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from microvllm.bench import hostile, hostile_events_tier, hostile_pd, hostile_proxy

SETS = {"pd": hostile_pd.run, "events-tier": hostile_events_tier.run, "proxy": hostile_proxy.run}
PASSED = "no poisoned answer, no server death, memory within 10 %, stream gaps under 1 s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="microvllm bench hostile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--quick", action="store_true", help="smaller sets (fewer 8 MB chats, fewer prefills)")
    parser.add_argument("--set", default="all", choices=["all", "server", *SETS], help="which set of attacks")
    args = parser.parse_args(argv)
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    if args.set in ("all", "server"):
        hostile.server_set(args, logs)
    verdicts = {}
    for name, run in SETS.items():
        if args.set in ("all", name):
            print(f"\n== {name} ==", flush=True)
            verdicts[name] = run(args.model, logs, args.quick)
    for name, ok in verdicts.items():
        print(f"{name}: {PASSED if ok else 'FAILED (see above)'}")
    return 0 if all(verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
