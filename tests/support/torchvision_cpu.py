"""Make torchvision importable beside the CPU build of torch, for the tests.

PyPI's x86_64 torchvision wheels are CUDA builds: their operator library links libtorch_cuda, so
next to the CPU torch it does not load, and ``import torchvision`` then fails while registering
fake kernels for two operators it did not define (``operator torchvision::nms does not exist``).
Importing this module defines those two operators' schemas, without kernels, when torchvision's
own library cannot load; the rest of torchvision (datasets, transforms) is pure Python and runs
as it is. Where torchvision loads its operators (a CUDA torch, or a CPU build of torchvision) this
module does nothing. Calling ``torchvision.ops.nms`` after it still fails, as it would anyway.
"""

from __future__ import annotations

import importlib.util


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
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    globals()["_LIBRARY"] = lib  # the definitions live as long as the library object


_prepare()
