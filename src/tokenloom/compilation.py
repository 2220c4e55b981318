"""What training (``train.compile``) and decoding (``GenerationConfig.compile``) share about ``torch.compile``:
whether it can run here, and whether an error came from the compiler (fall back) or from the model (raise)."""

from __future__ import annotations

import os
import shutil


def compile_unavailable() -> str | None:
    """Why ``torch.compile`` cannot run here, or None when it can."""
    import torch

    if not hasattr(torch, "compile"):
        return "this torch has no torch.compile"
    if not any(shutil.which(c) for c in filter(None, (os.environ.get("CXX"), "g++", "c++", "clang++"))):
        return "no C++ compiler (g++, c++ or clang++; or $CXX) for Inductor's CPU kernels"
    return None


def separate_inductor_cache() -> None:
    """Give a process whose CPU kernels are forced (``ATEN_CPU_CAPABILITY`` set, e.g. ``avx2``) an Inductor cache of its
    own, unless ``TORCHINDUCTOR_CACHE_DIR`` is set. Inductor's on-disk cache (torch 2.13) does not key its CPU kernels
    on that variable: a kernel compiled with AVX-512 vectors and loaded by a process forced to avx2 indexed out of
    bounds, and the other way round aborted the process. Call it before the first ``torch.compile``."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if capability and not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        import getpass
        import tempfile

        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = "unknown_user"
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(),
                                                             f"torchinductor_{user}-aten-{capability}")


def from_compiler(error: BaseException) -> bool:
    """Whether an exception came out of TorchDynamo / Inductor (not the model's own code)."""
    module = type(error).__module__ or ""
    return module.startswith(("torch._dynamo", "torch._inductor", "torch.fx", "torch._subclasses")) or \
        "BackendCompilerFailed" in type(error).__name__


def first_line(error: BaseException) -> str:
    """The error's first line (at most 200 characters), or its type's name."""
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__
