"""Llama 4's image processor without torchvision.

transformers' `Llama4ImageProcessor` is torchvision-only (imported at module level), and
transformers ships no PIL variant of it. `Llama4ImageProcessorPil` computes the same thing from
the same settings (`size`, `max_patches`, `resize_to_max_canvas`, `resample`, rescale and
normalize), with torch operations only:

1. The canvas: every (rows x cols) grid of `size` tiles with rows * cols <= max_patches is a
   possible canvas. The image's scale onto a canvas is the smaller of its two side ratios. The
   canvas picked is the one of the smallest scale >= 1 (the largest one with
   `resize_to_max_canvas`) or, when none reaches 1, of the largest scale; among canvases of
   that scale, the one of least area (the first of them in transformers' order).
2. The image is resized, keeping its aspect ratio, to fit inside the canvas; unless
   `resize_to_max_canvas`, no side is made larger than max(its own length, the tile side), so
   a small image is never blown up past one tile. It is padded with zeros (black) on the
   right and the bottom to the canvas.
3. Rescaled and normalized in bfloat16, as transformers does it, then cut into the canvas's
   tiles, row by row. When there is more than one tile, the whole image squeezed to one tile
   (its aspect ratio not kept) follows them as the global tile.

`pixel_values` are [tiles of all images, 3, side, side] and `aspect_ratios` [images, 2] the
(rows, cols) of each image's grid. The pixel values are the bfloat16 numbers transformers
computes, held in float32 (transformers returns them as bfloat16, which a float32 model cannot
take): cast to bfloat16 they are transformers' values bit for bit.

Resizing follows torchvision's tensor path, which transformers' processor runs: an image whose
size does not change is left as it is; otherwise `torch.nn.functional.interpolate` (bilinear or
bicubic, align_corners False, antialiased), directly on the uint8 pixels where torchvision does
that (bicubic, or bilinear on an AVX2/AVX512 CPU), else in float32 rounded back to uint8.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch
import torch.nn.functional as F
from transformers.image_processing_backends import PilBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import PILImageResampling
from transformers.processing_utils import ImagesKwargs


class Llama4ImageProcessorKwargs(ImagesKwargs, total=False):
    """max_patches: the most tiles an image's canvas holds (the global tile not counted).
    resize_to_max_canvas: pick the canvas the image grows most into (and fill it), instead of
    the one it needs least change for."""

    max_patches: int
    resize_to_max_canvas: bool


def canvas_grids(max_patches: int) -> list[tuple[int, int]]:
    """Every (rows, cols) grid of at most `max_patches` tiles, in transformers' order: grouped
    by aspect ratio (rows / cols) in the order each ratio first appears when the tile counts
    are walked from `max_patches` down to 1 and each count's (rows, cols) by rows ascending; a
    ratio's grids in the order they were met."""
    by_ratio: dict[Fraction, list[tuple[int, int]]] = {}
    for count in range(max_patches, 0, -1):
        for rows in range(1, count + 1):
            if count % rows == 0:
                cols = count // rows
                by_ratio.setdefault(Fraction(rows, cols), []).append((rows, cols))
    return [grid for grids in by_ratio.values() for grid in grids]


def best_canvas(
    image_size: tuple[int, int], canvases: list[tuple[int, int]], grow_most: bool = False
) -> tuple[int, int]:
    """The (height, width) in pixels, among `canvases`, that an image of `image_size` (height,
    width) goes onto. Scales are compared in float32, as transformers computes them."""
    h, w = image_size
    sizes = torch.tensor(canvases, dtype=torch.int64)
    scales = torch.minimum(sizes[:, 0] / h, sizes[:, 1] / w)  # float32
    up = scales[scales >= 1]
    if len(up):
        chosen = up.max() if grow_most else up.min()
    else:
        chosen = scales[scales < 1].max()
    candidates = sizes[scales == chosen]
    best = candidates[torch.argmin(candidates[:, 0] * candidates[:, 1])]
    return int(best[0]), int(best[1])


def fit_without_distortion(
    image_size: tuple[int, int], canvas: tuple[int, int], side: int, grow_most: bool = False
) -> tuple[int, int]:
    """The (height, width) the image is resized to on `canvas`, keeping its aspect ratio.

    transformers holds the canvas sides as 0-d int64 tensors and the image's as ints, and
    mixes them with Python's min/max: a limit that comes out as the canvas's side is a tensor,
    and the scale computed from it is float32 (else float64). Which of the two matters when
    the exact result is a whole number (floor of 223.99998 vs 224.0), so it is kept here."""
    h, w = image_size
    ch, cw = torch.tensor(canvas[0]), torch.tensor(canvas[1])
    if grow_most:
        limit_h, limit_w = ch, cw
    else:  # never past a tile's side for a small image, never past the canvas
        limit_h, limit_w = min(max(h, side), ch), min(max(w, side), cw)
    scale_w, scale_h = limit_w / w, limit_h / h
    if scale_w < scale_h:
        new_w, new_h = limit_w, min(math.floor(h * scale_w), limit_h)
    else:
        new_h, new_w = limit_h, min(math.floor(w * scale_h), limit_w)
    return max(int(new_h), 1), max(int(new_w), 1)


def _native_uint8(mode: str) -> bool:
    """Whether torchvision interpolates uint8 pixels directly on the CPU (its rule)."""
    if mode == "bicubic":
        return True
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


_MODES = {
    PILImageResampling.BILINEAR: "bilinear",
    PILImageResampling.BICUBIC: "bicubic",
}


def resize_like_torchvision(pixels: torch.Tensor, size: tuple[int, int], mode: str) -> torch.Tensor:
    """[C, H, W] uint8 pixels resized to `size` (height, width) as torchvision's tensor resize
    does it with antialiasing."""
    if tuple(pixels.shape[-2:]) == tuple(size):
        return pixels
    x = pixels[None]
    native = _native_uint8(mode)
    if not native:
        x = x.to(torch.float32)
    x = F.interpolate(x, size=list(size), mode=mode, align_corners=False, antialias=True)
    if not native:
        if mode == "bicubic":
            x = x.clamp_(0, 255)
        x = x.round_().to(torch.uint8)
    return x[0]


class Llama4ImageProcessorPil(PilBackend):
    """transformers' Llama4ImageProcessor computed without torchvision (module docstring)."""

    model_input_names = ["pixel_values"]
    resample = PILImageResampling.BILINEAR
    image_mean = [0.5, 0.5, 0.5]
    image_std = [0.5, 0.5, 0.5]
    size = {"height": 336, "width": 336}
    do_resize = True
    do_rescale = True
    do_normalize = True
    do_convert_rgb = True
    max_patches = 16
    resize_to_max_canvas = False
    valid_kwargs = Llama4ImageProcessorKwargs

    def __init__(self, **kwargs):
        super().__init__(**kwargs)

    def _rescale_and_normalize(self, x: torch.Tensor, do_rescale, factor, do_normalize, mean, std):
        """transformers' Llama 4 order and precision: bfloat16 when it does both."""
        if do_rescale and do_normalize:
            x = x.to(torch.bfloat16) * factor
        elif do_rescale:
            x = x.to(torch.float32) * factor
        if do_normalize:
            if not x.is_floating_point():
                x = x.to(torch.float32)
            m = torch.as_tensor(mean, dtype=x.dtype).view(-1, 1, 1)
            s = torch.as_tensor(std, dtype=x.dtype).view(-1, 1, 1)
            x = x.sub(m).div_(s)
        return x

    def _preprocess(
        self,
        images: list[np.ndarray],
        do_resize: bool,
        size,
        resample,
        do_rescale: bool,
        rescale_factor: float,
        do_normalize: bool,
        image_mean,
        image_std,
        max_patches: int,
        resize_to_max_canvas: bool,
        return_tensors=None,
        **kwargs,
    ) -> BatchFeature:
        if not do_resize:
            raise ValueError("Llama 4 always resizes images onto a canvas of tiles (do_resize)")
        if size.height != size.width:
            raise ValueError(f"Llama 4 tiles are square; size is {size.height}x{size.width}")
        side = size.height
        mode = _MODES.get(PILImageResampling(resample if resample is not None else 2))
        if mode is None:
            raise ValueError(f"Llama 4 image processor: unsupported resample {resample!r}")
        canvases = [(r * side, c * side) for r, c in canvas_grids(max_patches)]
        pixels, ratios = [], []
        for image in images:
            x = torch.from_numpy(np.ascontiguousarray(image))
            if x.dtype != torch.uint8:
                raise ValueError(f"Llama 4 image processor takes 8-bit images, got {x.dtype}")
            h, w = x.shape[-2:]
            canvas = best_canvas((h, w), canvases, resize_to_max_canvas)
            new = fit_without_distortion((h, w), canvas, side, resize_to_max_canvas)
            fitted = resize_like_torchvision(x, new, mode)
            fitted = F.pad(fitted, (0, canvas[1] - new[1], 0, canvas[0] - new[0]), value=0)
            norm = (do_rescale, rescale_factor, do_normalize, image_mean, image_std)
            fitted = self._rescale_and_normalize(fitted, *norm)
            rows, cols = canvas[0] // side, canvas[1] // side
            c = fitted.shape[0]
            tiles = (
                fitted.view(c, rows, side, cols, side)
                .permute(1, 3, 0, 2, 4)
                .reshape(rows * cols, c, side, side)
            )
            if rows * cols > 1:
                whole = resize_like_torchvision(x, (side, side), mode)
                tiles = torch.cat([tiles, self._rescale_and_normalize(whole, *norm)[None]])
            pixels.append(tiles.to(torch.float32))
            ratios.append(torch.tensor([rows, cols]))
        if return_tensors:
            data = {"pixel_values": torch.cat(pixels), "aspect_ratios": torch.stack(ratios)}
        else:
            data = {"pixel_values": pixels, "aspect_ratios": ratios}
        return BatchFeature(data=data, tensor_type=return_tensors)


__all__ = ["Llama4ImageProcessorPil", "best_canvas", "canvas_grids", "fit_without_distortion"]
