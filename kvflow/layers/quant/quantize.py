"""Weight-only quantization of float weights (`--quantization int8|int4`) into `BlockQuant` codes."""

from __future__ import annotations

import torch

from kvflow.layers.quant.packing import BlockQuant


def quantize_weight(w: torch.Tensor, scheme: str, group_size: int | None = None) -> BlockQuant:
    """w [N, K] float -> codes.

    int8: symmetric, w ~ s * q8 with |q8| <= 127, one scale per row (group_size None, the int8 kernel)
          or per `group_size` inputs (the Q8_0 layout). |error| <= s / 2 per weight.
    int4: asymmetric per group (default 32, like GGUF Q4_1), w ~ s * q + min with q in 0..15.
          |error| <= s / 2 + the bfloat16 rounding of s and min.
    """
    w = w.detach().float()
    n, k = w.shape
    if scheme == "int8":
        g = k if group_size is None else group_size
        _check_group(k, g)
        groups = w.view(n, k // g, g)
        scale = groups.abs().amax(-1) / 127.0
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q8 = torch.round(groups * inv.unsqueeze(-1)).clamp(-127, 127)
        q = (q8 + 128).to(torch.uint8).view(n, k)
        return BlockQuant(q, scale, -128.0 * scale, g, 8)
    if scheme == "int4":
        g = 32 if group_size is None else group_size
        _check_group(k, g)
        groups = w.view(n, k // g, g)
        lo, hi = groups.amin(-1), groups.amax(-1)
        # Round the scale and minimum to bfloat16 first so the codes are chosen for the values the kernel uses.
        scale = ((hi - lo) / 15.0).to(torch.bfloat16).float()
        lo = lo.to(torch.bfloat16).float()
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = torch.round((groups - lo.unsqueeze(-1)) * inv.unsqueeze(-1)).clamp(0, 15)
        return BlockQuant(q.to(torch.uint8).view(n, k), scale, lo, g, 4)
    raise ValueError(f"unknown quantization scheme {scheme!r}; use int8 or int4")


def _check_group(k: int, group_size: int) -> None:
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group size {group_size} must divide the input size {k}")
