"""A promoted model as a real MLflow model: `mlflow.pyfunc.load_model("models:/team.name@candidate")` predicts.

The export folder is itself the MLflow model directory (no copy of the weights): `MLmodel` names this module as
the pyfunc loader with the folder as its data, beside `model.safetensors` and `config.json` (trainforge's names,
what `init_from` and the registry read) and `hf/` (the Hugging Face Llama folder, for dense Llama models). No
pickle anywhere: the loader is code, the weights are safetensors (MLflow's `python_model` would be cloudpickled).

`predict` takes token ids (a 2-D int64 array, a list of lists, or a DataFrame whose rows are token lists) and
returns the next-token logits at the last position, float32 `[batch, vocab]`; `params={"all_positions": True}`
returns every position's logits `[batch, seq, vocab]`.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import numpy as np

LOADER = "trainforge.trainer.mlflow_model"


def write_mlmodel(out: Path, *, vocab: int, job_id: str) -> list[str]:
    """Make `out` (holding model.safetensors and config.json) an MLflow pyfunc model directory."""
    import mlflow
    import mlflow.pyfunc
    import safetensors
    import torch
    from mlflow.models import Model, ModelSignature
    from mlflow.types.schema import ParamSchema, ParamSpec, Schema, TensorSpec

    import trainforge

    signature = ModelSignature(inputs=Schema([TensorSpec(np.dtype(np.int64), (-1, -1), "tokens")]),
                               outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, vocab), "next_token_logits")]),
                               params=ParamSchema([ParamSpec("all_positions", "boolean", False)]))
    requirements = [f"trainforge=={trainforge.__version__}", f"torch=={torch.__version__.split('+')[0]}",
                    f"safetensors=={safetensors.__version__}", f"numpy=={np.__version__}",
                    f"mlflow=={mlflow.__version__}"]
    (out / "requirements.txt").write_text("\n".join(requirements) + "\n")
    (out / "python_env.yaml").write_text(f"python: {platform.python_version()}\nbuild_dependencies:\n- pip\n"
                                         "dependencies:\n- -r requirements.txt\n")
    model = Model(signature=signature, metadata={"trainforge.job_id": job_id})
    mlflow.pyfunc.add_to_model(model, loader_module=LOADER, data=".", python_env="python_env.yaml")
    model.save(str(out / "MLmodel"))
    return ["MLmodel", "requirements.txt", "python_env.yaml"]


class TrainforgeLM:
    """What `mlflow.pyfunc.load_model` wraps: the model rebuilt from config.json, weights from safetensors."""

    def __init__(self, folder: Path) -> None:
        import torch
        from safetensors.torch import load_file

        from trainforge.trainer.loop import load_entrypoint

        meta = json.loads((folder / "config.json").read_text())
        factory = load_entrypoint(meta["entrypoint"], "")  # trainforge's models, or the user's installed package
        torch.manual_seed(0)
        self.model = factory({**meta["model"], "max_seq_len": meta["seq_len"]})
        self.model.load_state_dict(load_file(str(folder / "model.safetensors")))
        self.model.eval()

    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> np.ndarray:
        import torch

        if isinstance(model_input, dict):  # MLflow hands a named tensor input over as {name: array}
            model_input = model_input.get("tokens", next(iter(model_input.values())))
        if hasattr(model_input, "to_numpy"):  # a DataFrame: one row of token ids per sequence
            model_input = [list(row[0]) if len(row) == 1 else list(row) for row in model_input.to_numpy()]
        tokens = torch.as_tensor(np.asarray(model_input, dtype=np.int64))
        if tokens.dim() == 1:
            tokens = tokens[None, :]
        with torch.no_grad():
            logits = self.model(tokens).float()
        if not (params or {}).get("all_positions"):
            logits = logits[:, -1, :]
        return logits.numpy()


def _load_pyfunc(data_path: str) -> TrainforgeLM:
    """MLflow's pyfunc loader hook (`loader_module` in MLmodel)."""
    return TrainforgeLM(Path(data_path))
