"""nnscaler's PyTorch bridge: `importer` traces an `nn.Module` into `dnn` MLIR (what
`nnscaler import torch` runs; docs/pytorch.md)."""

from .importer import SUPPORTED, import_module, supported_table

__all__ = ["SUPPORTED", "import_module", "supported_table"]
