"""``python -m jaxmirror.runtime.service_main ...``: the coordination service's helper process
(``runtime/service.py``; a module of its own, so that running it does not import ``service``
twice)."""

import sys

from jaxmirror.runtime import service

if __name__ == "__main__":
    service.main(sys.argv[1:])
