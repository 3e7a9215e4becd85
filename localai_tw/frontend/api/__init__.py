"""Every HTTP surface of a frontend replica: the OpenAI-compatible API, the admin and worker
APIs, probes, traces, metrics, generated files and the dashboard.  It may import the inference
core, jobs, the gallery and LocalAI's formats; none of those imports it."""
