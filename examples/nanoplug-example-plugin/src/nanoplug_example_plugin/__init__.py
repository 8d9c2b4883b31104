"""An example third-party nanoplug plugin: the attention backend in `chunked`, the weight format in `int8`
(each an entry point's module)."""
