"""Names of dtypes as configs and files spell them, and the torch dtypes they mean."""

from __future__ import annotations

import torch

EXPORT_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
"""`checkpoint.export_dtype` (and `convert --dtype`) -> the dtype floating tensors are cast to."""
