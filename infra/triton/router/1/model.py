"""Triton Python-backend router (BLS): the stable service name in front of champion and candidate.

Each request goes, whole and streaming, to one route drawn by weight. The model is decoupled, so
`execute` hands each request to a worker thread and returns at once: concurrent requests are
forwarded concurrently and the LLM models can batch them. (An async execute cannot `async for`
over a decoupled BLS response stream in this Triton release; iterating it would block the loop.)
"""

import json
import random

import triton_python_backend_utils as pb_utils

# model_text.py is tasks/serving/model_text.py, copied next to this file when the model is rendered
from model_text import Forwarder


def parse_routes(text):
    routes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = part.partition("=")
        routes.append((name.strip(), float(weight)))
    if not routes or sum(w for _, w in routes) <= 0:
        raise ValueError(f"routes {text!r}: need at least one MODEL=WEIGHT with a positive weight")
    return routes


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.routes = parse_routes(config["parameters"]["routes"]["string_value"])
        self.random = random.Random()
        self.forwarder = Forwarder(pb_utils, int(config["parameters"]["max_in_flight"]["string_value"]), "route")

    def pick(self):
        names, weights = zip(*self.routes, strict=True)
        return self.random.choices(names, weights=weights)[0]

    def execute(self, requests):
        self.forwarder.execute(requests, lambda request: (self.pick(), request.inputs()))
        return None

    def finalize(self):
        self.forwarder.shutdown()
