"""Where a served model may read its weights from: its own folder, or a folder its Triton's starter allows.

A rendered config names the folder a model loads (`model_dir`, a version's `adapter_dir`). The release and `llmops
serve` write those configs as data (tasks/serving/repository.py), and the process that starts tritonserver names the
folders a model may load from in LLMOPS_MODEL_ROOTS (the artifact store's local folders): a `model_dir` that resolves
anywhere else (a path planted through a config, a link out of the store) is refused by the model itself, before it
reads a byte. Without LLMOPS_MODEL_ROOTS (a Triton someone else started) the operator's layout stands.

Standard library only, and no project import: copied next to every model.py (tasks/serving/repository.py), and run
inside Triton's Python-backend stub.
"""

from __future__ import annotations

import os

FILE_NAME = "model_roots.py"  # the copy's name in a rendered model's version folder
ROOTS_ENV = "LLMOPS_MODEL_ROOTS"  # os.pathsep-separated folders, set by the process that starts tritonserver


def served_folder(args: dict, given: str, key: str = "model_dir") -> str:
    """The folder `key` names, as it resolves (relative: inside this model's version folder, where files sent with a
    load request land); ValueError where LLMOPS_MODEL_ROOTS is set and it lies outside the model's own folder and
    every root."""
    path = os.path.realpath(os.path.join(args["model_repository"], args["model_version"], given))
    if ROOTS_ENV not in os.environ:
        return path
    roots = [os.path.realpath(args["model_repository"])]
    roots += [os.path.realpath(root) for root in os.environ[ROOTS_ENV].split(os.pathsep) if root]
    if not any(path == root or path.startswith(root + os.sep) for root in roots):
        raise ValueError(
            f"{key} {given}: outside this model's folder and the artifact store ({os.pathsep.join(roots)})"
        )
    return path
