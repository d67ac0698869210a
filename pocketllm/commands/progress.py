"""The progress bar a long measuring command shows on rank 0, counted in prompt rows so the time
left weighs a 4096-row pass 8x a 512-row one. Other ranks get a bar that does nothing."""

from __future__ import annotations

from pocketllm.distributed.state import tp


class _NoBar:
    def set_description(self, desc: str) -> None:
        pass

    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def row_progress(total_rows: int, desc: str):
    """A tqdm bar over `total_rows` on rank 0; a do-nothing one elsewhere."""
    if tp().rank != 0:
        return _NoBar()
    from tqdm import tqdm

    # Drawn into a log too (unlike the byte-counting bars of loading and writing): a sweep or a
    # calibration runs for minutes, and its rep and setting are what a log of it can show.
    return tqdm(total=total_rows, unit="row", desc=desc, leave=False, dynamic_ncols=True, mininterval=1.0)
