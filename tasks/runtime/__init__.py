"""The runtime of `llmops serve`: the one authority over a service's state.

The deployment record (tasks/control/contract.py) is the desired state: the route table, the release that owns the service with
its lease and fencing epoch, and what that owner declared it loads. The replicas' loaded models are the actual state;
the fleet (fleet.py) converges the second to the first, and the gateway (gateway/) serves clients from the table and
takes every change through its control API. Releases are clients: they reach the runtime only over that API, through
tasks/serving/service.py, whose types are the contract's, and import nothing of this package (flows/release.py starts
standalone.py's gateway for a release that runs on a Triton of its own). The runtime imports no stage.
"""
