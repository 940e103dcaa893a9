"""A local S3-compatible server (moto's) on 127.0.0.1, so examples and tests run against ``s3://``.

    python storage/s3_server.py --port 9000 --bucket dlscale

creates the bucket, prints the ``storage_options`` to pass to dlscale (or to put under
``dlscale.storage.options`` with ``dlscale.storage.root: s3://dlscale``) and serves until interrupted.
It needs the ``test`` extra (``moto[server]`` and ``s3fs``). The data lives in memory and is gone
when the server stops.
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from typing import Any

HOST = "127.0.0.1"
KEY = SECRET = "testing"
REGION = "us-east-1"


def storage_options(endpoint: str) -> dict[str, Any]:
    """fsspec/s3fs options for the server at ``endpoint``."""
    return {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": endpoint, "region_name": REGION}}


def start(port: int = 0, buckets: tuple[str, ...] = ()) -> tuple[Any, str]:
    """Start the server on 127.0.0.1 (``port`` 0 picks a free one); return it and its endpoint URL."""
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer

    if port == 0:
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address=HOST, port=port)
    server.start()
    endpoint = f"http://{HOST}:{port}"
    if buckets:
        import boto3

        client = boto3.client(
            "s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET, region_name=REGION
        )
        for bucket in buckets:
            client.create_bucket(Bucket=bucket)
    return server, endpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=9000, help="port on 127.0.0.1 (0 picks a free one)")
    parser.add_argument("--bucket", action="append", default=None, help="bucket to create (repeatable)")
    args = parser.parse_args()
    server, endpoint = start(args.port, tuple(args.bucket or ["dlscale"]))
    print(f"S3 server at {endpoint}; buckets: {', '.join(args.bucket or ['dlscale'])}")
    print("storage_options =", json.dumps(storage_options(endpoint)))
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
