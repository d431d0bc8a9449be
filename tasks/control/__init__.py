"""The control API of `llmops serve` as both of its sides know it: the route table, the service's owner with its
fencing epoch and declared loads, and the deployment record that holds them (contract.py). Plain data and the
standard library, below the runtime (tasks/runtime/, which serves it) and the release's client of it
(tasks/serving/service.py, which writes it)."""
