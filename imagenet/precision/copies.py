"""Multi-tensor copies between lists of mixed dtypes (the fp16 model and its fp32 masters)."""

from __future__ import annotations

from ..base.torch_private import foreach_copy_


def dtype_groups(dst: list, src: list) -> list:
    """(dst, src) pairs split into lists of one (dst dtype, src dtype) each. The CUDA multi-tensor
    copy only takes lists of one dtype: a list mixing fp16 weights with fp32 BatchNorm parameters
    silently falls back to one copy (or memcpy) per tensor."""
    groups: dict = {}
    for d, s in zip(dst, src):
        pair = groups.setdefault((d.dtype, s.dtype), ([], []))
        pair[0].append(d)
        pair[1].append(s)
    return list(groups.values())


def copy_by_dtype(dst: list, src: list) -> None:
    """``torch._foreach_copy_(dst, src)``, one multi-tensor call per :func:`dtype_groups` group."""
    for d, s in dtype_groups(dst, src):
        foreach_copy_(d, s)
