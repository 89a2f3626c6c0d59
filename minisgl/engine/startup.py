"""Why a spawn-started child process died before it ran any of our code."""

from __future__ import annotations

import multiprocessing.spawn
import os


def spawn_main_problem() -> str | None:
    """A sentence when spawn cannot start children from this process, else None.

    multiprocessing's spawn re-runs the parent's main script in every child before the
    child's target. A script read from stdin or a deleted file cannot be re-run: each child
    dies at once with a FileNotFoundError printed on stderr.
    """
    data = multiprocessing.spawn.get_preparation_data("probe")
    path = data.get("init_main_from_path")
    if path is None or os.path.exists(path):
        return None
    return (
        f"multiprocessing's spawn re-runs the main script in every child process, and "
        f"{path!r} is not a file (a script read from stdin?): run it from a file, with the "
        f"entry point under `if __name__ == '__main__':`"
    )
