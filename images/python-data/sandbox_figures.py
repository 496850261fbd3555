"""Save matplotlib figures as PNGs that fit a byte budget (shared by the sandbox launchers)."""

import os

DPI_STEPS = (100, 72, 50, 36, 24)


def save_png(figure, path: str, max_bytes: int) -> None:
    """Save at the highest resolution whose file fits max_bytes (the smallest one otherwise)."""
    for dpi in DPI_STEPS:
        figure.savefig(path, dpi=dpi, format="png")
        if os.path.getsize(path) <= max_bytes:
            return
