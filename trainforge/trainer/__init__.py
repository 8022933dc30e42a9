"""The data plane: runs inside worker processes started by torchrun. Never imports Prefect or MLflow."""
