"""serve.lora adapter: the map from adapter names to adapter files that a base vLLM engine serves from.

The map is on the Triton host, private to the tritonserver process: `<maps>/llmops-lora-<tritonserver pid>-<its start
time>/<base model>/`, mode 700 (the start time: a PID the system hands out again, to a later Triton, gets a map of
its own instead of the earlier one's bindings), where `<maps>` is the folder its starter names in LLMOPS_ADAPTER_MAPS
(`$LLMOPS_HOME/triton/adapter-maps`, not a shared /tmp), else the temporary folder. A map that is a symbolic link, or
not this user's alone, is refused. The Triton's owner removes it when the Triton ends (forget_map), and the maps of
Tritons that ended without it (a SIGKILLed serve) at the next start (forget_ended_maps). Only loading a version's Triton model writes it (infra/triton/lora: its `initialize` registers
the adapter it came with, its `finalize` retires it), and loading a model needs Triton's control key; a request to
the base engine names an adapter by name only (`lora_name`) and the engine looks the name up here. A request cannot
name a folder, and a name, once bound to an adapter's weights, is never bound to other weights while that Triton
lives: a retired name keeps its digest (a tombstone), and loading it again with the same weights revives it.

Standard library only, and no project import: this file is copied next to the model.py of every model that uses it
(tasks/serving/repository.py), as model_text.py is, and runs inside Triton's Python-backend stub.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time

FILE_NAME = "adapter_registry.py"  # the copy's name in a rendered model's version folder
MAPS_ENV = "LLMOPS_ADAPTER_MAPS"  # the folder of the maps, set by the process that starts tritonserver


class RegistryError(Exception):
    """The registry refuses: a name bound to other weights, a folder that is not an adapter, an unsafe map."""


def registry_root(server_pid: int | None = None) -> str:
    """The map of the tritonserver process `server_pid` (the stub's parent), created private to this user."""
    import stat

    pid = server_pid or os.getppid()
    root = os.path.join(maps_folder(), f"llmops-lora-{pid}-{process_start(pid)}")
    try:
        os.mkdir(root, mode=0o700)
    except FileExistsError:
        pass
    status = os.lstat(root)  # a link planted at the name is not followed
    if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid() or status.st_mode & 0o077:
        raise RegistryError(f"adapter registry {root}: not a folder private to this user (owner {status.st_uid})")
    return root


def maps_folder() -> str:
    return os.environ.get(MAPS_ENV) or tempfile.gettempdir()


def process_start(pid: int) -> str:
    """When process `pid` started, in clock ticks after boot (field 22 of /proc/PID/stat, proc(5)); "0" where there
    is no /proc. With the PID it names one process, not every process that is ever given that PID."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:
            return stat.read().rsplit(")", 1)[1].split()[19]  # fields 3.. follow the command name's ")"
    except (OSError, IndexError):
        return "0"


def forget_map(server_pid: int, folder: str | None = None) -> None:
    """The maps of a tritonserver that has ended (whatever its start time: the PID is its own until it is reaped)."""
    import glob

    for root in glob.glob(os.path.join(folder or maps_folder(), f"llmops-lora-{server_pid}-*")):
        shutil.rmtree(root, ignore_errors=True)


def forget_ended_maps(folder: str) -> None:
    """The maps in `folder` whose tritonserver is no longer the process that made them (ended, or its PID reused)."""
    import glob

    for root in glob.glob(os.path.join(folder, "llmops-lora-*-*")):
        pid, _, started = os.path.basename(root).removeprefix("llmops-lora-").partition("-")
        if pid.isdigit() and process_start(int(pid)) != started:
            shutil.rmtree(root, ignore_errors=True)


def adapter_digest(folder: str) -> str:
    """sha256 over an adapter folder's file names and contents, in name order."""
    digest = hashlib.sha256()
    for base, dirs, files in sorted(os.walk(folder)):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(base, name)
            digest.update(os.path.relpath(path, folder).encode() + b"\0")
            with open(path, "rb") as source:
                for block in iter(lambda: source.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


def entry_path(root: str, base_model: str, name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise RegistryError(f"adapter name {name!r}: not a model name")
    return os.path.join(root, base_model, f"{name}.json")


def read_entry(root: str, base_model: str, name: str) -> dict | None:
    try:
        with open(entry_path(root, base_model, name), encoding="utf-8") as entry:
            return json.load(entry)
    except (OSError, ValueError):
        return None


def write_entry(path: str, entry: dict) -> None:
    staging = f"{path}.{os.getpid()}.tmp"
    with open(staging, "w", encoding="utf-8") as out:
        json.dump(entry, out)
    os.replace(staging, path)


def register(root: str, base_model: str, name: str, adapter_dir: str) -> dict:
    """Bind `name` to the adapter in `adapter_dir` (its files copied into the map) for `base_model`'s engine. A name
    bound to other weights is refused; the same weights again (a reload, a retired name loaded again) are accepted."""
    if not os.path.isfile(os.path.join(adapter_dir, "adapter_config.json")):
        raise RegistryError(f"adapter {name!r}: no adapter_config.json in {adapter_dir}")
    path = entry_path(root, base_model, name)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    digest = adapter_digest(adapter_dir)
    known = read_entry(root, base_model, name)
    if known is not None and known.get("digest") != digest:
        raise RegistryError(
            f"adapter {name!r} is bound to other weights on {base_model} (sha256 {str(known.get('digest'))[:12]}, "
            f"not {digest[:12]}); a name is never bound again: register the adapter as a new version"
        )
    files = os.path.join(os.path.dirname(path), name)
    if known is None or not os.path.isdir(files):
        staging = tempfile.mkdtemp(prefix=f".{name}-", dir=os.path.dirname(path))
        shutil.copytree(adapter_dir, staging, dirs_exist_ok=True)
        shutil.rmtree(files, ignore_errors=True)
        os.rename(staging, files)
    entry = {"name": name, "path": files, "digest": digest, "retired": False, "at": time.time()}
    write_entry(path, entry)
    return entry


def retire(root: str, base_model: str, name: str) -> None:
    """The version's model was unloaded: the engine stops serving `name` (it keeps its digest: a tombstone)."""
    entry = read_entry(root, base_model, name)
    if entry is not None and not entry.get("retired"):
        write_entry(entry_path(root, base_model, name), {**entry, "retired": True, "at": time.time()})


def active(root: str, base_model: str, name: str) -> dict | None:
    """The entry of `name` where it is registered and not retired, else None."""
    entry = read_entry(root, base_model, name)
    return entry if entry is not None and not entry.get("retired") else None
