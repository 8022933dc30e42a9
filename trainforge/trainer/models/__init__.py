"""Reference models (architecture only; parallelism is applied from outside)."""
