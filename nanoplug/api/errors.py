"""Errors a user sees: each says what went wrong and how to fix it."""


class NanoplugError(Exception):
    """Base of every error nanoplug raises on purpose."""


class UnknownPluginError(NanoplugError, ValueError):
    """A plugin name that no built-in or installed plugin provides."""


class PluginUnavailableError(NanoplugError, RuntimeError):
    """The chosen plugin (or every candidate of "auto") cannot serve this config."""


class PluginLoadError(NanoplugError, ImportError):
    """A plugin failed to import or declares an incompatible API version."""


class RequestError(NanoplugError, ValueError):
    """A request that cannot be served as given (too long, empty, bad token ids)."""


class ModelLoadError(NanoplugError, OSError):
    """A checkpoint that cannot be found or read."""


class AdapterError(NanoplugError, ValueError):
    """A weight adapter that does not fit the model, or of a type the chosen adapter plugin cannot apply."""


class WeightShapeError(ModelLoadError):
    """A checkpoint tensor whose shape is not the one the model built from config.json expects."""


class GraphCaptureError(NanoplugError, RuntimeError):
    """Decode graphs a platform was asked for could not be captured. Raised by `Platform.capture_graphs`; the
    worker records it and decodes eager, unless the platform's `require_graphs` option makes it stop start-up."""
