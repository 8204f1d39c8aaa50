"""The names of this process's threads, for tests that check a process group's threads ended."""

import glob
from pathlib import Path


def thread_names() -> list[str]:
    """Each live thread's name (Linux `/proc/self/task/*/comm`)."""
    names = []
    for comm in glob.glob("/proc/self/task/*/comm"):
        try:
            names.append(Path(comm).read_text().strip())
        except FileNotFoundError:  # that thread ended between the listing and the read
            pass
    return names
