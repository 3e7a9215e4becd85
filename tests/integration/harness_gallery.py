"""Gallery installs as a test drives them (``test_gallery.py``,
``test_download_destinations.py``): an index entry, admin calls to a replica, a job's state,
and the files a models directory holds."""

from __future__ import annotations

import json
import os

import treq

from .inference_harness import ADMIN

AUTH = {"Authorization": f"Bearer {ADMIN}"}
SMALL = b"tokenizer bytes " * 64


def entry(name: str, files: list[tuple[str, str, str | None]], description: str = "",
          **extra) -> dict:
    return {"name": name, "description": description, "license": "mit", "tags": ["test"],
            "config_file": f"backend: echo\nparameters:\n  model: {files[0][0]}\n"
                           "options: ['echo.dim:4']\n",
            "files": [{"filename": f, "uri": u, "sha256": d or ""} for f, u, d in files],
            **extra}


async def call(cluster, frontend, method: str, path: str, body=None, headers=AUTH):
    url = cluster.base_url(frontend) + path
    if method == "POST":
        answer = await treq.post(url, data=json.dumps(body or {}).encode(),
                                 headers={**headers, "Content-Type": "application/json"})
    else:
        answer = await treq.get(url, headers=headers)
    return answer.code, json.loads(await answer.content())


async def job(cluster, frontend, job_id: str):
    return await call(cluster, frontend, "GET", f"/models/jobs/{job_id}")


def model_files(models_dir: str) -> list[str]:
    """The files of the models directory, the content store's second names aside (what it
    holds is checked by :func:`stored_copies`)."""
    return sorted(os.path.relpath(os.path.join(d, n), models_dir)
                  for d, _, names in os.walk(models_dir) for n in names
                  if not os.path.relpath(d, models_dir).startswith(".blobs"))


def stored_copies(models_dir: str) -> list[str]:
    """The digests the models directory's content store holds (contentstore.py)."""
    store = os.path.join(models_dir, ".blobs", "sha256")
    return sorted(os.listdir(store)) if os.path.isdir(store) else []


async def _done(answer):
    code, body = await answer
    return (code, body) if code == 200 and body["state"] in ("done", "failed") else None
