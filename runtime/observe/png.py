"""Write an (H, W, 3) uint8 tensor as a PNG with the standard library (zlib), no imaging package."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import torch


def write_png(image: torch.Tensor, path: Path) -> None:
    if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError("expected an (H, W, 3) uint8 image")
    height, width, _ = image.shape
    rows = bytes(image.contiguous().flatten().tolist())
    stride = width * 3
    # Each scanline starts with filter type 0 (none).
    raw = b"".join(b"\x00" + rows[y * stride:(y + 1) * stride] for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
                           + chunk(b"IEND", b""))
