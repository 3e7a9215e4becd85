"""twistd plugin ``localai-frontend``: options and service tree live in localai_tw.frontend.tap."""

from twisted.application.service import ServiceMaker

localaiFrontend = ServiceMaker(
    "localai-frontend",
    "localai_tw.frontend.tap",
    "A localai-tw frontend replica: OpenAI API, worker tunnels, cluster state in PostgreSQL.",
    "localai-frontend",
)
