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


def from_compiler(error: BaseException) -> bool:
    """Whether an exception came out of TorchDynamo / Inductor (not the model's own code)."""
    module = type(error).__module__ or ""
    return module.startswith(("torch._dynamo", "torch._inductor", "torch.fx", "torch._subclasses")) or \
        "BackendCompilerFailed" in type(error).__name__


def first_line(error: BaseException) -> str:
    """The error's first line (at most 200 characters), or its type's name."""
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__
