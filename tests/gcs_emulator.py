"""A local Google Cloud Storage: gcp-storage-emulator on 127.0.0.1:<port>, in memory, with one bucket.

    python tests/gcs_emulator.py PORT BUCKET

Real GCS sends an object's generation in the `x-goog-generation` header of every media download;
tensorstore (Orbax's array writer) reads it to update an object conditionally and refuses a reply
without it ("Malformed StorageGeneration"). The emulator sends it in the JSON resource only, so here
each download also carries the header, as GCS's does. Everything else is the emulator's own.
"""

import logging
import sys
import threading

from gcp_storage_emulator import server
from gcp_storage_emulator.handlers import objects

_download = objects.download


def download(request, response, storage, *args, **kwargs):
    _download(request, response, storage, *args, **kwargs)
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except Exception:  # not found: the emulator has already answered 404
        return
    response["x-goog-generation"] = str(obj["generation"])
    response["x-goog-metageneration"] = str(obj["metageneration"])


objects.download = download  # objects.get calls it for ?alt=media
for _, handlers in server.HANDLERS:
    for method, handler in list(handlers.items()):
        if handler is _download:
            handlers[method] = download


if __name__ == "__main__":
    port, bucket = int(sys.argv[1]), sys.argv[2]
    logging.basicConfig(level=logging.CRITICAL)
    emulator = server.create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    emulator.start()  # listening once this returns
    print("ready", flush=True)
    threading.Event().wait()  # until the test session ends it (SIGTERM)
