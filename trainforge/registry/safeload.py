"""Safe loading: nothing from storage is unpickled with the stock unpickler.

- Weights files: `load_weights` reads `.safetensors` (no code at all) or a torch file with `weights_only=True`
  (torch's restricted unpickler: tensors and plain containers only). Anything else is refused.
- Distributed checkpoints (torch.distributed.checkpoint): the stock `FileSystemReader.read_metadata` calls
  `pickle.load` on `.metadata`, and `DefaultLoadPlanner.load_bytes` calls `torch.load(weights_only=False)` on
  non-tensor items. `SafeFileSystemReader` / `SafeLoadPlanner` replace both: metadata goes through an unpickler that
  only builds DCP's own metadata classes, and byte items through `weights_only=True`. Pass them to `dcp.load`:
      dcp.load(state, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner())
- `check_checkpoint_folder` refuses a checkpoint folder holding a raw pickle (`*.pkl`, `*.pt`, `*.bin`, ...).

A refused file raises `UnsafeCheckpointError` naming the file and what was in it. torch is imported lazily.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

SAFE_SUFFIXES = (".safetensors", ".distcp", ".json", ".metadata")
PICKLE_SUFFIXES = (".pkl", ".pickle", ".pt", ".pth", ".bin", ".ckpt")

# Globals DCP's .metadata may reference: its dataclasses and enums, torch dtypes/sizes/memory formats.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner", "torch.distributed.checkpoint._extension",
                "torch.distributed.checkpoint.storage", "torch.distributed.checkpoint.default_planner")
_TORCH_GLOBALS = {("torch", "Size"), ("torch", "memory_format"), ("torch", "device"),
                  ("torch._utils", "_rebuild_tensor_v2"), ("collections", "OrderedDict"),
                  ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
                  ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}


class UnsafeCheckpointError(ValueError):
    """A checkpoint or weights file would need arbitrary unpickling: refused."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module.startswith(_DCP_MODULES) or (module, name) in _TORCH_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"checkpoint metadata references {module}.{name}, which is not a checkpoint "
                                    "metadata type: refused (it could run code when loaded)")


def safe_metadata_load(stream: Any, source: str = "<metadata>") -> Any:
    try:
        return _MetadataUnpickler(stream).load()
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{source}: {exc}") from None


def load_weights(path: str | Path) -> dict[str, Any]:
    """Tensors from a `.safetensors` file, or from a torch file through `weights_only=True` only."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(f"{path} is not a plain weights file (weights_only=True refused it: "
                                    f"{str(exc).splitlines()[0]}); convert it to safetensors") from None


def check_checkpoint_folder(folder: str | Path) -> None:
    """Refuse a checkpoint folder that holds files only a full unpickler could read."""
    bad = [p.name for p in Path(folder).rglob("*") if p.is_file() and p.suffix in PICKLE_SUFFIXES]
    if bad:
        raise UnsafeCheckpointError(f"checkpoint {folder} holds pickle files {bad[:5]}: refused (weights load "
                                    "through safetensors or DCP only)")


def _dcp_classes() -> tuple[type, type]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                metadata = safe_metadata_load(f, str(path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            import torch

            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise UnsafeCheckpointError(f"checkpoint item {read_item.dest_index.fqn} would need arbitrary "
                                            f"unpickling: refused ({str(exc).splitlines()[0]})") from None
            if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes, minus its weights_only=False
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeFileSystemReader, SafeLoadPlanner


def SafeFileSystemReader(path: str | Path) -> Any:  # noqa: N802 (a class, built lazily: torch is optional here)
    return _dcp_classes()[0](str(path))


def SafeLoadPlanner(**kwargs: Any) -> Any:  # noqa: N802
    return _dcp_classes()[1](**kwargs)


def safe_dcp_load(state: dict[str, Any], folder: str | Path, *, no_dist: bool = False) -> None:
    """`dcp.load` through the safe reader and planner; an unsafe checkpoint raises UnsafeCheckpointError
    (DCP wraps rank errors in CheckpointException: the refusal is unwrapped so the user reads it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    check_checkpoint_folder(folder)
    metadata = Path(folder) / ".metadata"
    if metadata.is_file():  # checked here too: inside dcp.load the refusal surfaces only as a rank's error text
        with open(metadata, "rb") as f:
            safe_metadata_load(f, str(metadata))
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as exc:
        text = str(exc)
        marker = "UnsafeCheckpointError: "
        reason = next((line.split(marker, 1)[1] for line in text.splitlines() if marker in line), None)
        if reason is not None:
            raise UnsafeCheckpointError(f"checkpoint {folder} refused: {reason.strip()}") from None
        raise
