"""Boxes in a whole batch at once, on any device, no host sync: resized crops, each image's box
drawn as torchvision's RandomResizedCrop draws one, and resized bilinearly as its resized_crop
(without antialiasing) resizes one image (recipe.py's resized_crop calls both); random erasing
(recipe.py's --random-erase).
"""

import math

import torch

TRIES = 10  # RandomResizedCrop draws up to 10 boxes for one that fits, then takes the centre
GRID = 1024  # points of the aspect ratio's distribution: a box shape's error below 0.1%


def random_boxes(rand, height, width, scale, ratio):
    """(top, left, box height, box width), float64 (B,) in pixels, of a RandomResizedCrop(scale,
    ratio) box in each of B images of ``height`` x ``width``, from 4 uniform numbers per image
    ``rand`` (B, >= 4). torchvision draws (area fraction, log aspect) uniformly in (scale, log
    ratio) until the box fits the image, at most TRIES times, else takes the centre at the
    nearest allowed aspect. The same distribution here, without a loop: with the chance that
    all TRIES draws miss, the centre; else the aspect by the inverse of the distribution of the
    aspects that fit (on GRID points), then the fraction uniform among those that fit it."""
    device, (low, high) = rand.device, scale
    log_ratio = torch.linspace(math.log(ratio[0]), math.log(ratio[1]), GRID, dtype=torch.float64, device=device)

    def largest_fraction(t):  # the largest fraction of the area whose box of aspect e^t fits: (B,) or (GRID,)
        return torch.exp(-(t - math.log(width / height)).abs()).clamp(max=high)

    fits = (largest_fraction(log_ratio) - low).clamp(min=0)  # (GRID,) the fitting fractions' length per aspect
    cells = (fits[1:] + fits[:-1]) / 2  # (GRID - 1,) trapezoids
    missed = (1 - cells.mean() / (high - low)) ** TRIES  # the chance that every draw misses
    centred = rand[:, 0] < missed  # (B,)
    u_fraction = ((rand[:, 0] - missed) / (1 - missed)).clamp(0, 1)  # uniform again, given a fitting draw
    cdf = cells.cumsum(0) / cells.sum()  # (GRID - 1,)
    cell = torch.searchsorted(cdf, rand[:, 1].contiguous()).clamp(max=GRID - 2)  # (B,)
    start = torch.where(cell > 0, cdf[(cell - 1).clamp(min=0)], torch.zeros_like(rand[:, 1]))
    within = ((rand[:, 1] - start) / (cdf[cell] - start)).clamp(0, 1).nan_to_num(0.5)
    t = log_ratio[cell] + within * (log_ratio[1] - log_ratio[0])
    fraction = low + (largest_fraction(t) - low).clamp(min=0) * u_fraction
    box_h = (height * width * fraction / t.exp()).sqrt().clamp(max=height)
    box_w = (height * width * fraction * t.exp()).sqrt().clamp(max=width)
    # The centre, as torchvision's: the whole image cut to the nearest allowed aspect.
    centre_h, centre_w = ((width / ratio[0], width) if width / height < ratio[0] else
                          (height, height * ratio[1]) if width / height > ratio[1] else (height, width))
    box_h, box_w = torch.where(centred, centre_h, box_h), torch.where(centred, centre_w, box_w)
    top = torch.where(centred, (height - box_h) / 2, rand[:, 3] * (height - box_h))
    left = torch.where(centred, (width - box_w) / 2, rand[:, 2] * (width - box_w))
    return top, left, box_h, box_w


def crop_resize(images, top, left, height, width, size):
    """The part [top, top + height) x [left, left + width) of each image (B, H, W, C) (box
    edges (B,) float64, in pixels), resized bilinearly to ``size`` (h, w) as torchvision's
    resized_crop without antialiasing: pixel centres at +0.5, edges clamped to the part.
    Batched: one gather per axis, no loop over images, no host sync; uint8 in, uint8 out.
    Not torchvision.ops.roi_align(aligned=True), the batched library op closest to it: that
    samples half a pixel outside a box smaller than ``size``, where resized_crop (and the
    DataLoader's v2.RandomResizedCrop) clamp to it (tests/test_photos.py compares both)."""
    batch = torch.arange(len(images), device=images.device)[:, None]
    first_row, next_row, down = bilinear_taps(top, height, size[0], images.shape[1])  # (B, h)
    first_col, next_col, across = bilinear_taps(left, width, size[1], images.shape[2])  # (B, w)
    upper, lower = images[batch, first_row].float(), images[batch, next_row].float()  # (B, h, W, C)
    rows = (upper + (lower - upper) * down[:, :, None, None]).transpose(1, 2)  # (B, W, h, C)
    left_px, right_px = rows[batch, first_col], rows[batch, next_col]  # (B, w, h, C)
    out = (left_px + (right_px - left_px) * across[:, :, None, None]).transpose(1, 2)  # (B, h, w, C)
    return out.round().clamp(0, 255).to(torch.uint8) if images.dtype == torch.uint8 else out.to(images.dtype)


def bilinear_taps(start, length, out, size):
    """For ``out`` output pixels spread over [start, start + length) of an axis of ``size``
    pixels: the two source pixels of each, (B, out) int64, and the weight of the second,
    (B, out) float32."""
    steps = torch.arange(out, dtype=torch.float64, device=start.device) + 0.5
    centres = start[:, None] + steps * (length / out)[:, None] - 0.5  # (B, out), in source pixels
    centres = torch.minimum(torch.maximum(centres, start[:, None]), (start + length - 1)[:, None]).clamp(0, size - 1)
    first = centres.floor()
    return first.long(), (first + 1).clamp(max=size - 1).long(), (centres - first).float()


ERASE_SCALE = (0.02, 0.33)  # the erased box's share of the image's area (RandomErasing's defaults)
ERASE_RATIO = (0.3, 3.3)    # its aspect ratio, height / width, uniform in log


def random_erase(images, p):
    """torchvision's RandomErasing(p, scale=ERASE_SCALE, ratio=ERASE_RATIO, value=0) on a batch
    of normalized images (B, C, H, W), a box of its own for each image. Where torchvision tries
    up to 10 boxes for one that fits, this tries one: a box taller or wider than the image
    erases nothing. Its numbers come from the device's generator: no host sync, and a
    mid-epoch checkpoint keeps them."""
    batch, _, height, width = images.shape
    u = torch.rand(batch, 5, device=images.device)  # (B, 5): erase?, area, aspect, top, left
    area = height * width * (ERASE_SCALE[0] + (ERASE_SCALE[1] - ERASE_SCALE[0]) * u[:, 1])
    aspect = ERASE_RATIO[0] * (ERASE_RATIO[1] / ERASE_RATIO[0]) ** u[:, 2]
    box_h, box_w = (area * aspect).sqrt().round(), (area / aspect).sqrt().round()  # (B,) pixels
    erased = (u[:, 0] < p) & (box_h < height) & (box_w < width)
    top, left = (u[:, 3] * (height - box_h + 1)).floor(), (u[:, 4] * (width - box_w + 1)).floor()
    rows = torch.arange(height, device=images.device)[None]  # (1, H)
    cols = torch.arange(width, device=images.device)[None]  # (1, W)
    in_rows = (rows >= top[:, None]) & (rows < (top + box_h)[:, None])  # (B, H)
    in_cols = (cols >= left[:, None]) & (cols < (left + box_w)[:, None])  # (B, W)
    box = in_rows[:, :, None] & in_cols[:, None, :] & erased[:, None, None]  # (B, H, W)
    return images.masked_fill(box[:, None], 0.0)
