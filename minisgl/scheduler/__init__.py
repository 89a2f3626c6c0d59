"""Continuous-batching scheduler and request state (torch-free)."""

from minisgl.scheduler.batch import ScheduledBatch, ScheduledSeq
from minisgl.scheduler.request import Request
from minisgl.scheduler.scheduler import Scheduler, SchedulerStats

__all__ = ["Request", "ScheduledBatch", "ScheduledSeq", "Scheduler", "SchedulerStats"]
