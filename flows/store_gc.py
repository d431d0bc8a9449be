"""The store's garbage collection as a flow, for a schedule (infra/prefect.yaml: `store-gc`, daily); `llmops store
gc` runs the same collection without Prefect. What is kept and why: tasks/platform/store_gc.py."""

from __future__ import annotations

from prefect import flow, get_run_logger

from tasks.control.contract import recorded_digests
from tasks.platform.project import llmops_home
from tasks.platform.store_gc import collect_garbage, registered_digests, why_kept
from tasks.platform.stores import default_services, open_store
from tasks.platform.tracking import default_tracking_uri


@flow(name="store-gc", log_prints=True)
def store_gc(keep: int = 3, min_age_hours: float = 24.0, dry_run: bool = False) -> str:
    """Free the artifact store and the work folders of what no registered version, no deployment record and no recent
    record needs.

    Args:
        keep: the newest records of each kind (stage results, checkpoints, tuning) kept, with their artifacts.
        min_age_hours: nothing written more recently is touched (a release in progress may not have recorded it).
        dry_run: only report what would be freed.
    """
    tracking_uri, artifacts = default_services(None, None)
    home = llmops_home()
    live = why_kept(registered_digests(tracking_uri or default_tracking_uri(home)), recorded_digests(home))
    gc = collect_garbage(open_store(artifacts, home), home, live, keep, min_age_hours * 3600, dry_run)
    table = gc.table(dry_run)
    get_run_logger().info("\n" + table)
    return table
