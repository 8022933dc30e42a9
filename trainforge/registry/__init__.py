"""Checkpoint catalog and retention, MLflow tracking and model registry, lineage."""
