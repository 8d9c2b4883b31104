"""The errors a user sees are defined in the SDK (`nanoplug.api.errors`), so plugins raise the same ones."""
from nanoplug.api.errors import (AdapterError, ModelLoadError, NanoplugError, PluginLoadError,  # noqa: F401
                                 PluginUnavailableError, RequestError, UnknownPluginError)
