"""Write tensors with the Python `safetensors` and `numpy` packages (ml_dtypes for BF16 and
FP8), plus the exact bit patterns Python sees, for ttrace's interoperability test.

Usage: python3 write_fixtures.py OUT_DIR
"""
import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)

special = [0.0, -0.0, 1.0, -1.5, 3.140625, 1e-3, 448.0, -57344.0, 2.0**-9, 2.0**-16,
           float("inf"), float("-inf"), float("nan"), 65504.0, 1e-40, 6e-8]
types = {
    "f64": (np.float64, np.uint64),
    "f32": (np.float32, np.uint32),
    "f16": (np.float16, np.uint16),
    "bf16": (ml_dtypes.bfloat16, np.uint16),
    "e4m3": (ml_dtypes.float8_e4m3fn, np.uint8),
    "e5m2": (ml_dtypes.float8_e5m2, np.uint8),
}
tensors = {}
expected = {}
with np.errstate(all="ignore"):
    for name, (dt, bits) in types.items():
        a = np.array(special, dtype=np.float64).astype(dt).reshape(4, 4)
        tensors[name] = a
        expected[name] = {"shape": list(a.shape), "bits": [int(b) for b in a.view(bits).ravel()]}
        # npy: native floats as themselves, BF16 / FP8 as their bit patterns.
        np.save(out / f"{name}.npy", a if name in ("f64", "f32", "f16") else a.view(bits))
save_file(tensors, str(out / "all.safetensors"), metadata={"writer": "python safetensors"})
(out / "expected.json").write_text(json.dumps(expected))
