"""CPU pools on one node take turns on its cores.

Each CPU replica runs its passes with as many torch threads as the node has cores, and its
OpenMP team meets at a barrier after every parallel region (hundreds per pass). When the
draft's and the target's passes run at once on the same cores, each team's threads are
descheduled by the other's and every barrier waits out a time slice: a pass then takes
several times as long as the two passes one after the other (measured: concurrency 8
through the service ran speculation at a third of target-only's tokens/s). A request's
rounds are sequential anyway (draft, then score), so on a shared CPU node nothing is lost
by letting one pass hold the cores at a time: the pools take an exclusive lock on a file
of the node for each batch. (Loading does not take it: a replica starting beside serving
pools must not stall their requests for the seconds a load takes.)

GPU pools do not share their device, and a CPU pool given its own cores can turn it off
(`RunnerConfig.exclusive_cores: false`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
from pathlib import Path

logger = logging.getLogger("ray.serve")

__all__ = ["NodeCores", "lock_path"]


def lock_path() -> Path:
    """One lock per node (and per user): every CPU pool on the node shares these cores."""
    return Path(tempfile.gettempdir()) / f"specdec-cores-{os.getuid()}.lock"


class NodeCores:
    """`with cores.turn():` holds the node's cores for one pass (a no-op when disabled)."""

    def __init__(self, enabled: bool, path: Path | None = None):
        self._file = self._probe = None
        if not enabled:
            return
        path = path or lock_path()
        try:
            self._file = open(path, "a")
            # A second open file: flock locks belong to an open file, so probing through
            # the one that takes turns would see (and drop) this replica's own lock.
            self._probe = open(path, "a")
        except OSError as e:  # an unwritable temp dir: run unlocked rather than not at all
            logger.warning("could not open %s, CPU passes will not take turns: %s", path, e)
            self._file = self._probe = None

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def taken_by_another(self) -> bool:
        """Whether a pass holds the cores now (not this replica's own: it never probes
        during one of its passes)."""
        if self._probe is None:
            return False
        try:
            fcntl.flock(self._probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self._probe, fcntl.LOCK_UN)
        return False

    @contextlib.contextmanager
    def turn(self):
        if self._file is None:
            yield
            return
        fcntl.flock(self._file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._file, fcntl.LOCK_UN)
