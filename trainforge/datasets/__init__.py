"""Datasets: manifests and versions (pure), the embedded catalog, Arrow shards and the deterministic sampler."""
