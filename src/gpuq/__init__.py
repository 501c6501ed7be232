"""gpuq: an event-driven GPU job queue on PostgreSQL."""

from gpuq.producer import enqueue, enqueue_many
from gpuq.queue import NewJob

__all__ = ["NewJob", "enqueue", "enqueue_many"]
__version__ = "0.1.0"
