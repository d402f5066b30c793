"""``python -m graft_exp.tracking send DIR``: send the tracking records a job kept in its directory while its store
did not answer (``tracking.spool``; docs/tracking.md, "Tracking outages"). Exit 0: sent (or nothing to send); 1: the
store still does not answer; 2: refused (another database, a spool another process holds, no such directory). The
spool is kept unless it was sent."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from graft_exp.tracking.spool import SPOOL_DIR, StoreDown, send_left
from graft_exp.tracking.store import TrackingError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graft_exp.tracking",
                                     description="Send the tracking records a job kept while its store did not answer.")
    commands = parser.add_subparsers(dest="command", required=True)
    sending = commands.add_parser("send", help="send a job's spool, in order, each record once")
    sending.add_argument("job_dir", type=Path, help="the job's directory (<checkpoint_root>/<run key>)")
    sending.add_argument("--tracking-uri", help="the store to send to (default: the one the job logged to)")
    sending.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the store to answer")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not args.job_dir.is_dir():
        print(f"{args.job_dir} is not a directory: name the job's directory (<checkpoint_root>/<run key>)",
              file=sys.stderr)
        return 2
    try:
        sent = send_left(args.job_dir, args.tracking_uri, args.wait)
    except StoreDown as err:
        print(err, file=sys.stderr)
        return 1
    except TrackingError as err:
        print(err, file=sys.stderr)
        return 2
    print(f"sent {sent} tracking records from {args.job_dir / SPOOL_DIR}" if sent else
          f"no tracking spool in {args.job_dir}: nothing to send")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
