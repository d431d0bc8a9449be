"""`llmops store gc`: what the store and the work folders may let go of, and letting go of it.

Kept: every object a registered model version names (its source and each `artifact.<stage>.sha256` lineage tag, so
the champion's and a candidate's stages stay cache hits; every page of the registry), every object a deployment record
names (what `llmops serve` loads again at its next start, also for a version no longer in the registry: the callers
pass them in, tasks/control/contract.py:recorded_digests), the newest `keep` records of each record namespace
(stages/<stage>, checkpoints/train, tuning) with the objects they name, and anything written in the last
`min_age_s` (a run in progress may not have recorded it yet). Everything else goes: objects, records, the work
folders of finished stages, and temporary files of writes that never finished.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from tasks.platform.store import ArtifactStore, LocalStore, StoredObject, StoredRecord

GIB = 2**30


# Why an object is kept: digest -> the reasons ("registered tiny-qwen2-antonyms v3", "deployment record ...")
Live = dict[str, set[str]]


@dataclass
class GcPlan:
    kept_objects: int = 0
    kept_bytes: int = 0
    kept_live: list[tuple[StoredObject, set[str]]] = field(default_factory=list)  # named by a version or a record
    objects: list[StoredObject] = field(default_factory=list)
    records: list[StoredRecord] = field(default_factory=list)
    work: list[tuple[Path, int]] = field(default_factory=list)
    leftovers: list[tuple[Path, int]] = field(default_factory=list)

    @property
    def freed_bytes(self) -> int:
        return sum(o.bytes for o in self.objects) + sum(b for _, b in self.work) + sum(b for _, b in self.leftovers)

    def table(self, dry_run: bool) -> str:
        verb = "would free" if dry_run else "freed"
        rows = [
            ("objects", len(self.objects), sum(o.bytes for o in self.objects)),
            ("records", len(self.records), 0),
            ("work folders", len(self.work), sum(b for _, b in self.work)),
            ("unfinished writes", len(self.leftovers), sum(b for _, b in self.leftovers)),
        ]
        lines = [f"{'':<18} {'count':>7} {'GiB':>9}"]
        lines += [f"{name:<18} {count:>7} {size / GIB:>9.3f}" for name, count, size in rows]
        lines.append(f"store gc: {verb} {self.freed_bytes / GIB:.3f} GiB; kept {self.kept_objects} objects "
                     f"({self.kept_bytes / GIB:.3f} GiB)")  # fmt: skip
        if dry_run:  # what is kept for what lives, and why
            lines += [
                f"  kept {obj.digest[:12]} {obj.bytes / GIB:.3f} GiB: {'; '.join(sorted(reasons))}"
                for obj, reasons in sorted(self.kept_live, key=lambda kept: sorted(kept[1]))
            ]
        return "\n".join(lines)


def why_kept(*sources: Live) -> Live:
    """The reasons of several sources, merged per object."""
    merged: Live = {}
    for source in sources:
        for digest, reasons in source.items():
            merged.setdefault(digest, set()).update(reasons)
    return merged


def registered_digests(tracking_uri: str) -> Live:
    """Every object a registered model version names (its source and its lineage tags), through every page of the
    registry: a shared tracking server holds more than one page (100 models, MLflow's default) of other teams'."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    live: Live = {}
    token = None
    while True:
        page = client.search_model_versions(max_results=100, page_token=token)
        for found in page:
            version = client.get_model_version(found.name, found.version)  # tags in full
            why = f"registered {version.name} v{version.version}"
            named = {version.source.rstrip("/").rsplit("/", 1)[-1]}
            named |= {v for k, v in version.tags.items() if k.startswith("artifact.") and k.endswith(".sha256")}
            for digest in named:
                live.setdefault(digest, set()).add(why)
        token = page.token
        if not token:
            return live


def folder_bytes(path: Path) -> int:
    """Bytes deleting `path` frees: files with no other hard link (a stage's output linked into the store stays)."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]
    return sum(stat.st_size for stat in (p.stat() for p in files) if stat.st_nlink == 1)


def plan(store: ArtifactStore, home: Path, live: Live, keep: int, min_age_s: float) -> GcPlan:
    young = time.time() - min_age_s
    records = store.records()
    kept_records = records_to_keep(records, set(live), keep, young)
    keep_digests = set(live) | {d for r in records if (r.namespace, r.key) in kept_records and (d := artifact_of(r))}
    result = GcPlan(records=[r for r in records if (r.namespace, r.key) not in kept_records])
    for obj in store.objects():
        if obj.digest in keep_digests or obj.written > young:
            result.kept_objects += 1
            result.kept_bytes += obj.bytes
            if obj.digest in live:
                result.kept_live.append((obj, live[obj.digest]))
        else:
            result.objects.append(obj)
    result.work = finished_work(home / "work", young)
    if isinstance(store, LocalStore):
        result.leftovers = [(p, folder_bytes(p)) for p in store.leftovers() if p.stat().st_mtime <= young]
    return result


def records_to_keep(records: list[StoredRecord], registered: set[str], keep: int, young: float) -> set[tuple[str, str]]:
    """The newest `keep` of each namespace, those naming a registered object, and the young ones."""
    by_namespace: dict[str, list[StoredRecord]] = {}
    for record in records:
        by_namespace.setdefault(record.namespace, []).append(record)
    kept = set()
    for namespace_records in by_namespace.values():
        newest = sorted(namespace_records, key=lambda r: r.written, reverse=True)[:keep]
        kept |= {(r.namespace, r.key) for r in newest}
    return kept | {(r.namespace, r.key) for r in records if artifact_of(r) in registered or r.written > young}


def finished_work(work: Path, young: float) -> list[tuple[Path, int]]:
    """work/<stage>/<key> folders nothing has written to since `young`."""
    found = []
    for stage_folder in sorted(work.iterdir()) if work.is_dir() else []:
        for run_folder in sorted(stage_folder.iterdir()) if stage_folder.is_dir() else []:
            if newest_write(run_folder) <= young:
                found.append((run_folder, folder_bytes(run_folder)))
    return found


def artifact_of(record: StoredRecord) -> str | None:
    artifact = record.record.get("artifact") if isinstance(record.record, dict) else None
    return artifact.get("digest") if isinstance(artifact, dict) else None


def newest_write(folder: Path) -> float:
    return max((p.stat().st_mtime for p in folder.rglob("*")), default=folder.stat().st_mtime)


def collect(store: ArtifactStore, gc: GcPlan) -> None:
    """Delete what the plan lets go of: records first (a record never names a deleted object), then objects."""
    for record in gc.records:
        store.delete_record(record.namespace, record.key)
    for obj in gc.objects:
        store.delete(obj.digest)
    for path, _ in [*gc.work, *gc.leftovers]:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def collect_garbage(store: ArtifactStore, home: Path, live: Live, keep: int, min_age_s: float, dry_run: bool) -> GcPlan:
    """Plan a collection keeping what `live` names (why_kept of registered_digests and the deployment records) and,
    unless `dry_run`, carry it out."""
    gc = plan(store, home, live, keep, min_age_s)
    if not dry_run:
        collect(store, gc)
    return gc
