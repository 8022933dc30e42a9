"""Checkpoint internals: safe DCP reading, in-memory replicas."""
