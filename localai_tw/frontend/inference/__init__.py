"""The frontend's inference core: which node serves a model, cold loads under the cluster's lock,
model files and downloads, lifecycle, and the gRPC call through the owner's tunnel.  It knows no
HTTP; ``frontend.api`` programs against :mod:`.interfaces`."""
