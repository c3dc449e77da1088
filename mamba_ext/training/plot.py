"""The loss-curve PNG of a training run: matplotlib when it is installed (the field's
standard), else a writer of its own that needs zlib only.

The picture: axes with their titles and ticks, the training loss per step (light), its
moving average (dark), the held-out loss at the end (a marker), an optional dashed
reference line (e.g. ln(vocab), the loss of a uniform guess) and a legend naming each;
the built-in writer draws its text with a tiny bitmap font.
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
    ",": (0, 0, 0, 2, 4), "/": (1, 1, 2, 4, 4), ":": (0, 2, 0, 2, 0),
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
HELD_OUT_COLOR = (230, 120, 0)     # the held-out loss's marker
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


def _moving_average(y, smooth):
    """Trailing moving average over up to k steps (k ~ 5% of the run, <= smooth)."""
    k = max(1, min(int(smooth), y.size // 20))
    c = np.concatenate([[0.0], np.cumsum(y)])
    i = np.arange(1, y.size + 1)
    return (c[i] - c[np.maximum(i - k, 0)]) / np.minimum(i, k)


def _ticks(lo, hi, n=5):
    """About n round values spanning [lo, hi] (steps of 1, 2 or 5 times a power of 10)."""
    span = hi - lo if hi > lo else 1.0
    raw = span / max(n - 1, 1)
    mag = 10 ** np.floor(np.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = np.ceil(lo / step) * step
    return [float(v) for v in np.arange(first, hi + step * 1e-9, step)]


def loss_curve(losses, reference=None, width=640, height=400, smooth=50,
               reference_label="reference", held_out=None) -> np.ndarray:
    """Render the curve with the built-in writer as an (height, width, 3) uint8 image.

    Axis titles :data:`X_TITLE` / :data:`Y_TITLE` with ticks; a legend in the top margin
    names the raw loss, its moving average, the ``held_out`` loss (a marker at the last
    step, if given) and the dashed ``reference`` line (if given), labelled
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
    if held_out is not None and np.isfinite(held_out):
        entries.append((HELD_OUT_COLOR, f"held-out: {held_out:.3f}", -1))
    if reference is not None:
        entries.append((REFERENCE_COLOR, reference_label, 6))
    lx = right - 8 * max(len(label) for _, label, _ in entries) - 30
    for i, (color, label, dash) in enumerate(entries):
        ly = 4 + 11 * i
        if dash < 0:            # a marker
            img[ly + 2:ly + 8, lx + 7:lx + 13] = color
        else:
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

    def px(step):
        return left + step * ((right - left) / max(y.size - 1, 1))

    xs = px(np.arange(y.size))
    _polyline(img, xs, py(y), RAW_COLOR)
    _polyline(img, xs, py(_moving_average(y, smooth)), AVERAGE_COLOR)
    if reference is not None:
        _line(img, left, py(reference), right, py(reference), REFERENCE_COLOR, dash=6)
    if held_out is not None and np.isfinite(held_out) and lo <= held_out <= hi:
        cx, cy = int(px(y.size - 1)), int(py(held_out))
        img[max(cy - 3, 0):cy + 4, max(cx - 3, 0):cx + 4] = HELD_OUT_COLOR
    for v in _ticks(lo, hi):                 # y ticks with labels
        _line(img, left - 4, py(v), left, py(v), TEXT_COLOR)
        _text(img, 4, int(py(v)) - 5, f"{v:g}", TEXT_COLOR)
    for v in _ticks(1, y.size, 5):           # x ticks: steps (1-based)
        if 1 <= v <= y.size:
            x = int(px(v - 1))
            _line(img, x, bottom, x, bottom + 4, TEXT_COLOR)
            label = f"{int(v)}"
            _text(img, min(x - 4 * len(label), right - 8 * len(label)), bottom + 6, label,
                  TEXT_COLOR, scale=1)
    return img


def _matplotlib_png(losses, reference, reference_label, held_out, smooth) -> bytes | None:
    """The picture drawn by matplotlib (through its object API and the Agg canvas: no
    pyplot state, no global setting changed), or None when it is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    import io
    y = np.asarray(losses, dtype=np.float64).reshape(-1)
    steps = np.arange(1, y.size + 1)
    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    rgb = lambda c: tuple(v / 255 for v in c)
    if y.size:
        ax.plot(steps, y, color=rgb(RAW_COLOR), lw=0.8, label="training loss per step")
        fin = np.isfinite(y)
        if fin.any():
            ax.plot(steps[fin], _moving_average(y[fin], smooth), color=rgb(AVERAGE_COLOR), lw=1.6,
                    label="moving average")
    if held_out is not None and np.isfinite(held_out):
        ax.plot([max(y.size, 1)], [held_out], "o", color=rgb(HELD_OUT_COLOR), ms=7,
                label=f"held-out loss {held_out:.3f}")
    if reference is not None:
        ax.axhline(reference, color=rgb(REFERENCE_COLOR), ls="--", lw=1, label=reference_label)
    ax.set_xlabel(X_TITLE)
    ax.set_ylabel(Y_TITLE)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def write_loss_curve(path, losses, reference=None, held_out=None, reference_label="reference",
                     smooth=50) -> str:
    """Write the loss-curve PNG atomically (temp file + os.replace); returns the writer
    used: "matplotlib" when it is installed, else "built-in"."""
    from ..io.checkpoint import atomic_write
    data = _matplotlib_png(losses, reference, reference_label, held_out, smooth)
    used = "matplotlib"
    if data is None:
        used = "built-in"
        data = png_bytes(loss_curve(losses, reference, smooth=smooth,
                                    reference_label=reference_label, held_out=held_out))
    atomic_write(path, lambda f: f.write(data))
    return used
