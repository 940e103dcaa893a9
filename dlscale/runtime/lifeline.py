"""Nanny preload of the embedded cluster: a nanny process ends, and its worker with it, once the
driver that started it is gone.

The driver holds the write end of the nanny process's standard input and never writes to it; when
the driver exits, however it exits, the kernel closes that end and the read here returns. The nanny
then closes as on ``SIGTERM`` (``dask spec`` closes its servers gracefully), and its worker process
follows it, as every worker process follows its nanny.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any


def _wait_for_driver() -> None:
    while os.read(0, 4096):  # nothing is ever written: only the end of the input returns
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def dask_setup(nanny: Any) -> None:
    """Watch standard input from a daemon thread (Dask calls this as the nanny starts)."""
    threading.Thread(target=_wait_for_driver, name="dlscale driver lifeline", daemon=True).start()
