"""Loss-curve PNG written with zlib only (no plotting library).

The picture: axes with their titles, the raw loss per step (light), its moving
average (dark), an optional dashed reference line (e.g. ln(vocab), the loss of a
uniform guess), a legend naming each line, and the y-axis range / last step,
all text written with a tiny bitmap font.
"""
from __future__ import annotations

import struct
import zlib

import numpy as np

# 3x5 bitmap glyphs (rows top to bottom, 3 bits each, MSB left); text is drawn upper-case
_GLYPHS = {
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7),
    "4": (5, 5, 7, 1, 1), "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 1, 1),
    "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7), ".": (0, 0, 0, 0, 2), "-": (0, 0, 7, 0, 0),
    " ": (0, 0, 0, 0, 0), "(": (2, 4, 4, 4, 2), ")": (2, 1, 1, 1, 2), "=": (0, 7, 0, 7, 0),
    ",": (0, 0, 0, 2, 4), "/": (1, 1, 2, 4, 4),
    "A": (2, 5, 7, 5, 5), "B": (6, 5, 6, 5, 6), "C": (3, 4, 4, 4, 3), "D": (6, 5, 5, 5, 6),
    "E": (7, 4, 6, 4, 7), "F": (7, 4, 6, 4, 4), "G": (3, 4, 5, 5, 3), "H": (5, 5, 7, 5, 5),
    "I": (7, 2, 2, 2, 7), "J": (1, 1, 1, 5, 2), "K": (5, 5, 6, 5, 5), "L": (4, 4, 4, 4, 7),
    "M": (5, 7, 7, 5, 5), "N": (6, 5, 5, 5, 5), "O": (2, 5, 5, 5, 2), "P": (6, 5, 6, 4, 4),
    "Q": (2, 5, 5, 6, 3), "R": (6, 5, 6, 5, 5), "S": (3, 4, 2, 1, 6), "T": (7, 2, 2, 2, 2),
    "U": (5, 5, 5, 5, 7), "V": (5, 5, 5, 5, 2), "W": (5, 5, 7, 7, 5), "X": (5, 5, 2, 5, 5),
    "Y": (5, 5, 2, 2, 2), "Z": (7, 1, 2, 4, 7),
}

# colours (RGB) of the curves, also used by their legend entries
RAW_COLOR = (170, 190, 230)        # the loss of every step
AVERAGE_COLOR = (20, 40, 160)      # its trailing moving average
REFERENCE_COLOR = (200, 30, 30)    # the dashed reference line
TEXT_COLOR = (0, 0, 0)
X_TITLE = "training step"
Y_TITLE = "loss (nats)"


def png_bytes(rgb: np.ndarray) -> bytes:
    """Encode an (H, W, 3) uint8 image as PNG (8-bit RGB, no filtering)."""
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    h, w, c = rgb.shape
    if c != 3:
        raise ValueError(f"rgb: expected shape (H, W, 3), got {rgb.shape}")

    def chunk(tag, data):
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    raw = np.concatenate([np.zeros((h, 1), np.uint8), rgb.reshape(h, w * 3)], axis=1)
    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw.tobytes(), 9))
            + chunk(b"IEND", b""))


def _line(img, x0, y0, x1, y1, color, dash=0):
    n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    xs = np.rint(np.linspace(x0, x1, n)).astype(int)
    ys = np.rint(np.linspace(y0, y1, n)).astype(int)
    if dash:
        keep = (np.arange(n) // dash) % 2 == 0
        xs, ys = xs[keep], ys[keep]
    ok = (xs >= 0) & (xs < img.shape[1]) & (ys >= 0) & (ys < img.shape[0])
    img[ys[ok], xs[ok]] = color


def _polyline(img, xs, ys, color):
    for i in range(len(xs) - 1):
        _line(img, xs[i], ys[i], xs[i + 1], ys[i + 1], color)
    if len(xs) == 1:
        _line(img, xs[0], ys[0], xs[0], ys[0], color)


def _text(img, x, y, s, color, scale=2):
    for ch in s.upper():
        rows = _GLYPHS.get(ch, _GLYPHS[" "])
        for r, bits in enumerate(rows):
            for cc in range(3):
                if bits >> (2 - cc) & 1:
                    img[y + r * scale:y + (r + 1) * scale, x + cc * scale:x + (cc + 1) * scale] = color
        x += 4 * scale


def loss_curve(losses, reference=None, width=640, height=400, smooth=50,
               reference_label="reference") -> np.ndarray:
    """Render the curve as an (height, width, 3) uint8 image.

    Axis titles :data:`X_TITLE` / :data:`Y_TITLE`; a legend in the top margin names the
    raw loss, its moving average and (if given) the dashed ``reference`` line, labelled
    ``reference_label``.
    """
    y = np.asarray(losses, dtype=np.float64).reshape(-1)
    y = y[np.isfinite(y)] if y.size else y
    img = np.full((height, width, 3), 255, np.uint8)
    left, right, top, bottom = 60, width - 15, 50, height - 30
    _line(img, left, top, left, bottom, TEXT_COLOR)
    _line(img, left, bottom, right, bottom, TEXT_COLOR)
    _text(img, 4, 4, Y_TITLE, TEXT_COLOR)
    _text(img, (left + right) // 2 - 4 * len(X_TITLE), bottom + 12, X_TITLE, TEXT_COLOR)
    # legend: one row per line, a short sample of the line then its label
    entries = [(RAW_COLOR, "loss per step", 0), (AVERAGE_COLOR, "moving average", 0)]
    if reference is not None:
        entries.append((REFERENCE_COLOR, reference_label, 6))
    lx = right - 8 * max(len(label) for _, label, _ in entries) - 30
    for i, (color, label, dash) in enumerate(entries):
        ly = 4 + 14 * i
        for dy in (4, 5):
            _line(img, lx, ly + dy, lx + 20, ly + dy, color, dash=dash and 4)
        _text(img, lx + 26, ly, label, TEXT_COLOR)
    if y.size == 0:
        return img
    hi = max(float(y.max()), reference or -np.inf)
    lo = min(float(y.min()), 0.0)
    span = hi - lo if hi > lo else 1.0

    def py(v):
        return bottom - (np.asarray(v) - lo) / span * (bottom - top)

    xs = left + np.arange(y.size) * ((right - left) / max(y.size - 1, 1))
    _polyline(img, xs, py(y), RAW_COLOR)
    # trailing moving average over up to k steps (k ~ 5% of the run, <= smooth)
    k = max(1, min(int(smooth), y.size // 20))
    c = np.concatenate([[0.0], np.cumsum(y)])
    i = np.arange(1, y.size + 1)
    ma = (c[i] - c[np.maximum(i - k, 0)]) / np.minimum(i, k)
    _polyline(img, xs, py(ma), AVERAGE_COLOR)
    if reference is not None:
        _line(img, left, py(reference), right, py(reference), REFERENCE_COLOR, dash=6)
    for v in (lo, hi):   # y-axis labels and ticks
        _line(img, left - 4, py(v), left, py(v), TEXT_COLOR)
        _text(img, 4, int(py(v)) - 5, f"{v:.2f}", TEXT_COLOR)
    _text(img, right - 40, bottom + 12, str(y.size), TEXT_COLOR)
    return img


def write_loss_curve(path, losses, reference=None, **kw) -> None:
    """Write the loss-curve PNG atomically (temp file + os.replace)."""
    from ..io.checkpoint import atomic_write
    data = png_bytes(loss_curve(losses, reference, **kw))
    atomic_write(path, lambda f: f.write(data))
