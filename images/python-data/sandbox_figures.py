"""matplotlib in the sandbox: its font list built into the image, and figures saved as PNGs that fit a
byte budget (shared by the sandbox launchers)."""

import os

DPI_STEPS = (100, 72, 50, 36, 24)
FONT_CACHE = "/usr/local/share/sandbox/matplotlib"
"""matplotlib's font list, built when the image was (building it takes about 0.2 s)."""


def seed_font_cache() -> None:
    """Put the image's font list where matplotlib looks for it (MPLCONFIGDIR, on the sandbox's empty /tmp),
    before matplotlib is imported; never raises (matplotlib then builds it itself)."""
    target = os.environ.get("MPLCONFIGDIR")
    if not target:
        return
    try:
        os.makedirs(target, exist_ok=True)
        for name in os.listdir(FONT_CACHE):
            if not os.path.exists(os.path.join(target, name)):
                with (
                    open(os.path.join(FONT_CACHE, name), "rb") as kept,
                    open(os.path.join(target, name), "wb") as seeded,
                ):
                    seeded.write(kept.read())  # small: importing shutil cost a cell more
    except OSError:
        pass


def save_png(figure, path: str, max_bytes: int) -> None:
    """Save at the highest resolution whose file fits max_bytes (the smallest one otherwise), cut to what is drawn
    as Jupyter's inline backend does (a tight bounding box): a label below the axes, such as pandas' rotated
    dates push down, is in the picture, not cut off at the figure's edge."""
    for dpi in DPI_STEPS:
        figure.savefig(path, dpi=dpi, format="png", bbox_inches="tight", pad_inches=0.1)
        if os.path.getsize(path) <= max_bytes:
            return
