"""gRPC channel options that once made a slow handshake look like a dead backend."""

from localai_tw.backends import process
from localai_tw.frontend.inference import backend_client


def test_no_client_sets_the_minimum_connect_timeout_below_the_default():
    # gRPC core reads grpc.min_reconnect_backoff_ms as the minimum connect timeout: at 100 ms a
    # loaded replica's bridge connection failed UNAVAILABLE without any dial error, which the
    # frontend then took for the backend's answer and reaped a healthy model.
    for options in (backend_client.CHANNEL_OPTIONS, process.CHANNEL_OPTIONS):
        assert "grpc.min_reconnect_backoff_ms" not in dict(options)
