"""Arrays in the form the Rust core reads: a NumPy array and the name of its format.

float64, float32 and float16 arrays pass as they are; BF16 and FP8 values (torch tensors, or
ml_dtypes arrays) pass as views of their bit patterns (uint16 / uint8). Nothing is copied
except a torch tensor that lives on another device or is not contiguous.
"""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from .errors import InvalidInputError

_NUMPY = {"float64": "f64", "float32": "f32", "float16": "f16"}
_BITS = {
    "bfloat16": ("bf16", np.uint16),
    "float8_e4m3fn": ("e4m3", np.uint8),
    "float8_e5m2": ("e5m2", np.uint8),
}


def format_of_dtype(dtype: Any) -> str:
    """The ttrace format name of a torch or NumPy floating-point dtype (``"bf16"``, ...)."""
    name = str(dtype).replace("torch.", "")
    if name in _NUMPY:
        return _NUMPY[name]
    if name in _BITS:
        return _BITS[name][0]
    raise InvalidInputError(
        f"dtype {dtype} has no ttrace format (float64, float32, float16, bfloat16, "
        "float8_e4m3fn, float8_e5m2)",
        "UnknownFormat",
    )


def _torch_view(t: Any) -> np.ndarray:
    import torch

    t = t.detach()
    if type(t) is not torch.Tensor and hasattr(t, "to_local"):
        raise InvalidInputError(
            "a DTensor: pass t.full_tensor() (the logical tensor) or t.to_local() (this rank's "
            "shard)",
            "InvalidParameter",
        )
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    name = str(t.dtype).replace("torch.", "")
    if name in _NUMPY:
        return t.numpy()
    if name in _BITS:
        fmt, bits = _BITS[name]
        signed = torch.int16 if bits is np.uint16 else torch.uint8
        return t.view(signed).numpy().view(bits)
    format_of_dtype(t.dtype)  # raises with the list of supported dtypes
    raise AssertionError("unreachable")


def as_core(x: Any, what: str = "array") -> Tuple[np.ndarray, str]:
    """``(array, format)`` for the core from a torch tensor, a NumPy array, or numbers."""
    if type(x).__module__.startswith("torch"):
        try:
            arr = _torch_view(x)
        except InvalidInputError as e:
            raise InvalidInputError(f"{what}: {e}", e.kind) from None
        return arr, format_of_dtype(x.dtype)
    if isinstance(x, np.ndarray):
        name = x.dtype.name
        if name in _NUMPY:
            return x, _NUMPY[name]
        if name in _BITS:
            fmt, bits = _BITS[name]
            return np.ascontiguousarray(x).view(bits), fmt
        raise InvalidInputError(
            f"{what}: dtype {x.dtype} has no ttrace format (float64, float32, float16, "
            "bfloat16, float8_e4m3fn, float8_e5m2)",
            "UnknownFormat",
        )
    if x is None:
        # NumPy reads None as a NaN scalar: an omitted operand must not become one.
        raise InvalidInputError(f"{what}: None is not an array", "InvalidParameter")
    try:
        return np.asarray(x, dtype=np.float64), "f64"
    except (TypeError, ValueError) as e:
        raise InvalidInputError(f"{what}: not an array of numbers ({e})", "InvalidParameter") from None


def as_float64(x: Any, what: str = "array") -> np.ndarray:
    """The exact values of ``x`` as float64 (BF16 and FP8 decoded by the core)."""
    from . import _ttrace

    arr, fmt = as_core(x, what)
    return _ttrace.to_float64(arr, fmt)
