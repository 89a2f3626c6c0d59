"""Loaded by the tensor-parallel follower processes a test starts with this folder on PYTHONPATH.

MINISGL_TEST_JOIN_FAILURE makes every rank but 0 fail as it joins torch.distributed, after it
has checked in with rank 0: "raise" raises (the rank reports its error), "exit" leaves at once
(nothing reported, only its exit code).
"""

import os

_HOW = os.environ.get("MINISGL_TEST_JOIN_FAILURE")

if _HOW:
    import torch.distributed as dist

    _join = dist.init_process_group

    def _failing_join(*args, **kwargs):
        if kwargs.get("rank", 0) > 0:
            if _HOW == "exit":
                os._exit(3)
            raise RuntimeError("injected: this rank could not join the group")
        return _join(*args, **kwargs)

    dist.init_process_group = _failing_join
