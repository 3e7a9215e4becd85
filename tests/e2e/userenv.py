"""The environment a user's shell gives the installed ``twistd``: this process's, without
``PYTHONPATH`` (or any other way to put a checkout on the import path) and without
``LOCALAI_*`` settings.  Every e2e test of the user's path starts its processes with it, so a
developer's shell that sets ``PYTHONPATH`` cannot make a broken install pass."""

from __future__ import annotations

import os

#: What a user's shell does not carry into the test's processes.
NOT_THE_USERS = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "XDG_DATA_HOME")


def user_environment(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("LOCALAI_") and k not in NOT_THE_USERS}
    env.update(extra)
    return env
