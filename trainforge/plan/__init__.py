"""Pure planning: hardware catalog, cluster description, model shapes, memory / communication / step-time
models and the auto-parallelism advisor. No torch.distributed, no Prefect, no MLflow, no network, no I/O
beyond reading a cluster or model description file the caller names."""
