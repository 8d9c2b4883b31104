"""The same server with the engine core in a process of its own (`--engine-process`): the tests of
test_server.py that exercise the engine side (texts, streams, usage, refusals the engine makes,
aborts, shutdown), run again across the msgpack socket."""
from __future__ import annotations

import pytest

from _server import start_server
from test_server import (  # noqa: F401  (fixtures and tests collected again here, on this module's server)
    client, llm, test_bad_requests_are_400_with_openai_shaped_bodies, test_chat_applies_the_template,
    test_completion_is_the_engines_greedy_text_with_usage, test_disconnect_mid_stream_aborts_and_frees_blocks,
    test_disconnect_while_waiting_for_a_whole_response_aborts, test_prompt_forms_keep_their_order_and_n_gives_n_choices,
    test_streamed_text_equals_the_whole_text,
)
from test_server import assert_signal_ends_streams


@pytest.fixture(scope="module")
def server(request):
    return start_server(request, "--engine-process")


def test_signal_ends_streams_and_stops_the_engine_process(request):
    import psutil

    server = start_server(request, "--engine-process")
    (child,) = psutil.Process(server.pid).children()
    assert_signal_ends_streams(server, "SIGTERM")
    child.wait(timeout=20)  # raises if the engine process outlives the server
