"""Prefect flows: orchestration only."""
