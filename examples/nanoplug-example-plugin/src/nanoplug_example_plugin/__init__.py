"""An example third-party nanoplug plugin; the backend lives in `chunked` (the entry point's module)."""
