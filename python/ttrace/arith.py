"""The arithmetic PyTorch actually runs: autocast, TF32 and reduced-precision FP32 matmuls.

A trace must say what its GPU computed, not only what dtypes stored it: with
``torch.backends.cuda.matmul.allow_tf32`` (what ``torch.set_float32_matmul_precision("high")``
sets) every FP32 GEMM rounds its inputs to TF32 (10 fraction bits), and under
``torch.autocast`` a linear layer of FP32 tensors multiplies FP16 or BF16 copies and rounds
its result to them, whatever dtype later stores the gradients. :func:`module_settings` reads
these settings for one module call; the :class:`~ttrace.Tracer` writes them into each tensor's
``module`` entry (``papers/trace-format.md``), and the checker prices with them.

Reading the settings changes nothing: no process-wide state is touched.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

__all__ = ["module_settings", "run_settings"]

_FORMATS = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}


def _autocast(device_type: str) -> Optional[str]:
    """The autocast dtype in force on ``device_type`` (None when autocast is off)."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type) if enabled else None
    except (TypeError, RuntimeError, AttributeError):
        # PyTorch before 2.4: one query per device kind.
        if device_type == "cpu":
            enabled = torch.is_autocast_cpu_enabled()
            dtype = torch.get_autocast_cpu_dtype() if enabled else None
        else:
            enabled = torch.is_autocast_enabled()
            dtype = torch.get_autocast_gpu_dtype() if enabled else None
    if not enabled or dtype is None:
        return None
    # A dtype ttrace has no name for is written as torch names it: the checker then refuses
    # to price the tensor rather than price it as something else.
    return _FORMATS.get(dtype, str(dtype).replace("torch.", ""))


def _precision(setting: Any) -> Optional[str]:
    """``tf32`` / ``bf16`` from a ``fp32_precision`` setting, None for full precision."""
    if setting in (None, "none", "ieee", "highest"):
        return None
    return str(setting)


def _fp32_matmul(device_type: str) -> Optional[str]:
    """The format FP32 matmul inputs are rounded to on ``device_type``, None for none."""
    if device_type == "cuda":
        prec = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
        if prec not in (None, "none"):
            return _precision(prec)
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else None
    if device_type == "cpu":
        mkldnn = getattr(torch.backends, "mkldnn", None)
        matmul = getattr(mkldnn, "matmul", None)
        prec = getattr(matmul, "fp32_precision", None)
        if prec is not None:
            return _precision(prec)
        # Before PyTorch 2.9: oneDNN's BF16 path for "medium".
        return "bf16" if torch.get_float32_matmul_precision() == "medium" else None
    return None


def _fp32_conv(device_type: str) -> Optional[str]:
    """The format FP32 convolution inputs are rounded to (cuDNN's TF32, on by default)."""
    if device_type != "cuda":
        return None
    conv = getattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision", None)
    if conv not in (None, "none"):
        return _precision(conv)
    return "tf32" if torch.backends.cudnn.allow_tf32 else None


def module_settings(device_type: str) -> Dict[str, str]:
    """The arithmetic settings of a module call on ``device_type`` (``"cuda"``, ``"cpu"``),
    as the manifest's ``module`` fields: ``autocast``, ``fp32_matmul``, ``fp32_conv`` (only
    those in force) and ``device``."""
    out: Dict[str, str] = {"device": device_type}
    autocast = _autocast(device_type)
    if autocast is not None and autocast != "f32":
        out["autocast"] = autocast
    for key, value in (("fp32_matmul", _fp32_matmul(device_type)),
                       ("fp32_conv", _fp32_conv(device_type))):
        if value is not None:
            out[key] = value
    return out


def run_settings() -> Dict[str, Any]:
    """What the manifest records about the run as a whole (informational): PyTorch's
    version, the float32 matmul precision, the GPU's name and CUDA version when there is one,
    and cuBLAS's reduced-precision reductions of FP16/BF16 GEMMs."""
    out: Dict[str, Any] = {
        "torch": torch.__version__,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.version.cuda
        out["gpu"] = torch.cuda.get_device_name()
        matmul = torch.backends.cuda.matmul
        out["fp16_reduced_precision_reduction"] = bool(
            getattr(matmul, "allow_fp16_reduced_precision_reduction", False))
        out["bf16_reduced_precision_reduction"] = bool(
            getattr(matmul, "allow_bf16_reduced_precision_reduction", False))
    return out
