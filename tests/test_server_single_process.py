"""The same server with the engine core stepping in a thread of the server's process
(`--single-process`): the tests of test_server.py that exercise the engine side (texts, streams,
usage, refusals the engine makes, aborts, shutdown), run again on that layout."""
from __future__ import annotations

import pytest

from _server import start_server
from test_server import (  # noqa: F401  (fixtures and tests collected again here, on this module's server)
    assert_signal_ends_streams, client, llm, test_bad_requests_are_400_with_openai_shaped_bodies,
    test_chat_applies_the_template, test_completion_is_the_engines_greedy_text_with_usage,
    test_disconnect_mid_stream_aborts_and_frees_blocks, test_disconnect_while_waiting_for_a_whole_response_aborts,
    test_prompt_forms_keep_their_order_and_n_gives_n_choices, test_streamed_text_equals_the_whole_text,
)


@pytest.fixture(scope="module")
def server(request):
    return start_server(request, "--single-process")


def test_signal_ends_open_streams_with_an_error_and_exits(request):
    import psutil

    server = start_server(request, "--single-process")
    assert psutil.Process(server.pid).children() == []  # no engine process: the engine is a thread
    assert_signal_ends_streams(server, "SIGTERM")
