"""DCP reading without unpickling code from storage.

DCP writes two pickles: the `.metadata` file and, inside the shard files, non-tensor values (torch.save'd). Its
stock reader unpickles both with the full pickle machinery, so a crafted checkpoint could run code on load.
`SafeFileSystemReader` reads `.metadata` with an unpickler that resolves only DCP's own metadata classes and
torch's plain value types; `SafeLoadPlanner` loads the non-tensor values with `torch.load(weights_only=True)`
(tensors already load that way). Anything else is refused with `UnsafeCheckpointError`.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "StorageMeta", "ChunkStorageMetadata",
                                              "TensorStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
                                              "TensorProperties", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """The checkpoint's metadata references something other than DCP's plain data classes."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.layout | torch.memory_format):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"refused to unpickle {module}.{name} from checkpoint metadata")


def read_metadata_bytes(data: bytes) -> Metadata:
    metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"checkpoint metadata is a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = read_metadata_bytes(f.read())
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(f"checkpoint item {read_item.dest_index.fqn} would need arbitrary "
                                        f"unpickling: refused ({str(exc).splitlines()[0]})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
