"""Make torchvision importable beside the CPU build of torch, for the tests.

PyPI's x86_64 torchvision wheels are CUDA builds: their operator library links libtorch_cuda, so
next to the CPU torch it does not load, and ``import torchvision`` then fails while registering
fake kernels for two operators it did not define (``operator torchvision::nms does not exist``).
Importing this module loads torchvision's operator library first; only when that fails does it
define the two operators' schemas, without kernels. The rest of torchvision (datasets,
transforms) is pure Python and runs as it is. Where the library loads (a CUDA torch, or a CPU
build of torchvision), defining the schemas would make its later registration of the same
operators abort the process, so the library is loaded instead and torchvision's own import finds
it loaded. Calling ``torchvision.ops.nms`` after the shim still fails, as it would anyway.
"""

from __future__ import annotations

import glob
import importlib.util
import os


def _operators_load(folders: list[str]) -> bool:
    """Whether torchvision's operator library (``_C*.so`` in its package) loads beside this torch."""
    import torch

    for folder in folders:
        for path in sorted(glob.glob(os.path.join(folder, "_C*.so"))):
            try:
                torch.ops.load_library(path)  # torchvision's import loads it again: the same library
            except (OSError, RuntimeError):
                return False
            return True
    return False


def _prepare() -> None:
    spec = importlib.util.find_spec("torchvision")
    if spec is None:
        return
    import torch

    try:
        torch.ops.torchvision.nms  # noqa: B018  (already defined: torchvision's library loaded)
        return
    except (AttributeError, RuntimeError):
        pass
    if _operators_load(list(spec.submodule_search_locations or ())):
        return
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    globals()["_LIBRARY"] = lib  # the definitions live as long as the library object


_prepare()
