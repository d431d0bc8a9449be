"""Triton Python-backend router (BLS): the stable service name in front of champion and candidate.

Each request goes, whole and streaming, to one route drawn by weight. The model is decoupled, so
`execute` hands each request to a worker thread and returns at once: concurrent requests are
forwarded concurrently and the LLM models can batch them. (An async execute cannot `async for`
over a decoupled BLS response stream in this Triton release; iterating it would block the loop.)
"""

import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import triton_python_backend_utils as pb_utils


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
        self.workers = ThreadPoolExecutor(max_workers=64, thread_name_prefix="route")
        # requests forwarded and not yet answered; past max_in_flight a request is refused in execute
        self.max_in_flight = int(config["parameters"]["max_in_flight"]["string_value"])
        self.in_flight, self.count_lock = 0, threading.Lock()

    def pick(self):
        names, weights = zip(*self.routes, strict=True)
        return self.random.choices(names, weights=weights)[0]

    def execute(self, requests):
        for request in requests:
            with self.count_lock:
                admitted = self.in_flight < self.max_in_flight
                self.in_flight += admitted
            if admitted:
                self.workers.submit(self.forward, request)
            else:
                busy = pb_utils.TritonError(
                    f"the service has {self.max_in_flight} requests in flight; retry shortly",
                    pb_utils.TritonError.UNAVAILABLE,
                )
                request.get_response_sender().send(
                    pb_utils.InferenceResponse(error=busy), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
                )
        return None

    def forward(self, request):
        try:
            self.route(request)
        finally:
            with self.count_lock:
                self.in_flight -= 1

    def route(self, request):
        sender = request.get_response_sender()
        try:
            call = pb_utils.InferenceRequest(
                model_name=self.pick(), inputs=request.inputs(), requested_output_names=["text_output"]
            )
            for response in call.exec(decoupled=True):
                if response.has_error():
                    raise RuntimeError(response.error().message())
                output = pb_utils.get_output_tensor_by_name(response, "text_output")
                if output is not None:
                    sender.send(pb_utils.InferenceResponse(output_tensors=[output]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:
            sender.send(
                pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )

    def finalize(self):
        self.workers.shutdown(wait=True)  # a reload waits for requests in flight to finish
