"""The optional CUDA device: cheap detection here, kernels and backend in submodules.

Importing this package imports neither numba nor numba.cuda, so `--device auto` can ask whether a
GPU is there without paying for (or failing on) numba-cuda. `CUDABackend` is loaded on first
access. numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) runs the same kernels in Python for the
tests; it is never taken for a GPU.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys

from localllm.errors import LocalLLMError

__all__ = ["CUDABackend", "gpu_available", "gpu_problem", "require_gpu"]

INSTALL_HINT = "pip install 'localllm[cuda]'"
# the NVIDIA driver's library, which a machine with a usable GPU has
_DRIVER_LIBRARIES = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")


def simulator_enabled() -> bool:
    """Whether numba's CUDA simulator is switched on (then numba.cuda is not a GPU)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0").strip() not in ("", "0"):
        return True
    numba = sys.modules.get("numba")
    return bool(getattr(getattr(numba, "config", None), "ENABLE_CUDASIM", 0))


def numba_cuda_installed() -> bool:
    """Whether the numba-cuda package can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("numba_cuda") is not None
    except (ImportError, ValueError):
        return False


def _load_driver():
    """The NVIDIA driver library, or None when it is not installed."""
    for name in _DRIVER_LIBRARIES:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _driver_device_count(driver) -> tuple[int, int]:
    """(CUresult of cuInit, number of devices) straight from the driver API."""
    status = driver.cuInit(0)
    if status != 0:
        return status, 0
    count = ctypes.c_int(0)
    status = driver.cuDeviceGetCount(ctypes.byref(count))
    return status, count.value


def gpu_problem() -> str | None:
    """Why the CUDA backend cannot run here, in words for the user; None when it can."""
    if simulator_enabled():
        return (
            "NUMBA_ENABLE_CUDASIM is set, so numba.cuda is the CUDA simulator (for tests), "
            "not a GPU; unset it to use a real GPU"
        )
    if not numba_cuda_installed():
        return f"the CUDA backend needs numba-cuda, which is not installed; {INSTALL_HINT}"
    driver = _load_driver()
    if driver is None:
        return "no NVIDIA driver found (libcuda could not be loaded); is there an NVIDIA GPU?"
    status, count = _driver_device_count(driver)
    if status != 0:
        return f"the NVIDIA driver failed to initialise (CUDA error {status}); check nvidia-smi"
    if count == 0:
        return "the NVIDIA driver reports no GPU"
    from numba import cuda  # only now: a driver and a device are there

    if not cuda.is_available():
        return (
            "numba-cuda cannot use the GPU (see `python -c 'from numba import cuda; "
            f"cuda.detect()'`); {INSTALL_HINT} brings the CUDA libraries it needs"
        )
    return None


def gpu_available() -> bool:
    """True when a real GPU and numba-cuda are usable (never for the simulator). Cheap when
    there is no driver: numba.cuda is imported only once a device has been found."""
    return gpu_problem() is None


def require_gpu() -> None:
    """Raise LocalLLMError saying what is missing when the CUDA backend cannot run."""
    problem = gpu_problem()
    if problem is not None:
        raise LocalLLMError(f"--device cuda: {problem}; or use --device cpu")


def __getattr__(name: str):
    if name == "CUDABackend":  # imports numba.cuda: only when the backend is really wanted
        from localllm.cuda.backend import CUDABackend

        return CUDABackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
