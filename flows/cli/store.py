"""`llmops store gc`: free the artifact store and the work folders (tasks/platform/store_gc.py)."""

from __future__ import annotations

import argparse
import os

from tasks.platform.errors import BadInput
from tasks.platform.project import llmops_home

EPILOG = """examples:
  llmops store gc --dry-run              # what would be freed, nothing deleted
  llmops store gc                        # keep the 3 newest records of each kind and everything of the last 24 h
  llmops store gc --keep 1 --min-age 0   # keep only what registered versions and the newest records name

kept: every object a registered model version names (source and lineage; every page of the registry), so the
champion's and a candidate's stages stay cache hits; every object a deployment record of `llmops serve` names
($LLMOPS_HOME/serving/*.json: what it loads again at its next start, also for a version deleted from the registry);
the newest --keep records of each kind with their objects; anything younger than --min-age hours. --dry-run lists
each object kept for a version or a record, and why. A daily `store-gc` deployment runs the same collection
(infra/prefect.yaml)."""


def register(commands) -> None:
    store = commands.add_parser(
        "store",
        help="manage the artifact store: gc frees what no registered version, deployment or recent record needs",
        description="The content-addressed artifact store ($LLMOPS_HOME/store, or --artifacts).",
    )
    actions = store.add_subparsers(dest="action", required=True, metavar="ACTION")
    gc = actions.add_parser(
        "gc",
        help="delete objects, records and work folders nothing needs",
        description="Delete store objects and records that no registered model version, no deployment record and no "
        "recent record names, the work folders of finished stages, and unfinished writes.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gc.add_argument("--dry-run", action="store_true", help="print what would be freed; delete nothing")
    gc.add_argument("--keep", type=int, default=3, help="newest records of each kind to keep (default 3)")
    gc.add_argument(
        "--min-age", type=float, default=24.0, metavar="HOURS", help="touch nothing younger (default 24 hours)"
    )
    gc.add_argument("--artifacts", help="artifact store: folder or s3://bucket/prefix (default: $LLMOPS_HOME/store)")
    gc.add_argument("--tracking-uri", help="MLflow tracking URI of the registry (default: sqlite under $LLMOPS_HOME)")
    gc.set_defaults(handler=command_gc)


def command_gc(args) -> str:
    from tasks.control.contract import recorded_digests
    from tasks.platform.store_gc import collect_garbage, registered_digests, why_kept
    from tasks.platform.stores import open_store
    from tasks.platform.tracking import default_tracking_uri

    if args.keep < 0 or args.min_age < 0:
        raise BadInput(f"--keep {args.keep} / --min-age {args.min_age}: must be 0 or more")
    home = llmops_home()
    artifacts = args.artifacts or os.environ.get("LLMOPS_ARTIFACTS")
    tracking_uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(home)
    live = why_kept(registered_digests(tracking_uri), recorded_digests(home))
    gc = collect_garbage(open_store(artifacts, home), home, live, args.keep, args.min_age * 3600, args.dry_run)
    return gc.table(args.dry_run)
