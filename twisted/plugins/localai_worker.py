"""twistd plugin ``localai-worker``: options and service tree live in localai_tw.worker.tap."""

from twisted.application.service import ServiceMaker

localaiWorker = ServiceMaker(
    "localai-worker",
    "localai_tw.worker.tap",
    "A localai-tw worker: registers with a frontend and serves backends through its tunnel.",
    "localai-worker",
)
