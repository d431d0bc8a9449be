"""`python -m flows.train_node`: the train stage's part of one node, in each pod a Kubernetes engine starts
(tasks/training/kubernetes.py: a Kubeflow Trainer TrainJob, a JobSet or an indexed Job).

The pod's environment carries the training request (`LLMOPS_STAGE_REQUEST`: the validated profile, the store,
the MLflow run, the stage's inputs) and its node's place (NNODES, NPROC_PER_NODE, NODE_RANK, MASTER_ADDR,
MASTER_PORT, or Kubeflow Trainer's PET_* names). Node 0 runs the train stage (it follows the trainer log,
stores checkpoints and the adapter, and writes the stage's record, which the release then reads); the others run
their launch only. A profile setting that runs code must equal this image's profile file of the same name, as
for a remote stage.
"""

from __future__ import annotations

import json
import os
import sys

from tasks.platform.config import Profile, check_received_profile
from tasks.platform.errors import LlmopsError
from tasks.platform.project import llmops_home
from tasks.platform.stage_cache import RunContext, StageResult
from tasks.platform.stores import open_store
from tasks.platform.tracking import Tracker
from tasks.train import train, train_other_node
from tasks.training.kubernetes import REQUEST_ENV, launch_variables


def run_node(environ: dict[str, str]) -> None:
    request = json.loads(environ[REQUEST_ENV])
    profile = Profile.model_validate(request["profile"])
    check_received_profile(profile)
    launch = launch_variables(environ)
    os.environ.update(launch)  # LlamaFactory's launcher reads them from its environment
    home = llmops_home()
    tracker = Tracker(request["tracking_uri"], request["mlflow_run_id"], request["experiment_id"])
    ctx = RunContext(profile, open_store(request["artifacts"], home), tracker, home)
    data, base = (StageResult.from_dict(i) for i in request["inputs"])
    if launch["NODE_RANK"] == "0":
        train(ctx, data, base, one_node_of_many=True)
    else:
        train_other_node(ctx, data, base)


def main() -> None:
    try:
        run_node(dict(os.environ))
    except (LlmopsError, KeyError) as exc:
        print(f"llmops train node: error: {exc}", file=sys.stderr)
        sys.exit(getattr(exc, "exit_code", 2))


if __name__ == "__main__":
    main()
