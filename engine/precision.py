"""--precision: which dtype the forward pass computes in (autocast), and the TF32 switches."""

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch

from engine.errors import UserError

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    name: str                     # bf16, fp16, tf32 or fp32
    autocast_dtype: object = None  # torch dtype for autocast, None for fp32 math

    def autocaster(self, device):
        """A function of no arguments that returns the forward pass's context on ``device``:
        built once, so that a step enters torch.autocast (or nullcontext) directly."""
        if self.autocast_dtype is None:
            return nullcontext
        return partial(torch.autocast, device.type, dtype=self.autocast_dtype)

    def autocast(self, device):
        return self.autocaster(device)()


def configure_precision(requested, device):
    """Resolve --precision for ``device`` and set the TF32 switches; refuse combinations that
    cannot work."""
    cuda = device.type == "cuda"
    # Only bf16 the GPU computes natively: PyTorch reports emulated bf16 (pre-Ampere GPUs) as
    # supported by default, and it runs slower than fp32 there.
    native_bf16 = cuda and torch.cuda.is_bf16_supported(including_emulation=False)
    if requested == "auto":
        requested = "bf16" if native_bf16 else "fp32"
    if requested in ("fp16", "tf32") and not cuda:
        raise UserError(f"--precision {requested} needs a CUDA GPU; on the CPU use fp32 (or bf16)")
    if requested == "bf16" and cuda and not native_bf16:
        raise UserError("--precision bf16: this GPU has no bf16 support; use fp16 or fp32")
    if cuda:
        # PyTorch lets cuDNN use TF32 for convolutions by default, so the guide's "fp32" was
        # partly TF32. Here fp32 means fp32; every other mode allows TF32 for fp32 leftovers.
        set_tf32(matmuls=requested != "fp32", convolutions=requested != "fp32")
    return Precision(requested, AUTOCAST_DTYPES.get(requested))


def set_tf32(matmuls, convolutions):
    """Allow TF32 for fp32 matmuls and cuDNN convolutions, or not, through the setters every
    supported PyTorch has. From 2.9 on they set ``fp32_precision`` too, so that the older
    reads (``allow_tf32``, ``get_float32_matmul_precision``: TunableOp, a user's code) and the
    newer (``fp32_precision``: inductor) agree; setting ``fp32_precision`` instead makes the
    older reads raise ("a mix of the legacy and new APIs")."""
    torch.set_float32_matmul_precision("high" if matmuls else "highest")  # "high": TF32 on CUDA
    torch.backends.cudnn.allow_tf32 = convolutions
