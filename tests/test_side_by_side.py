"""The side-by-side tool's comparison (``scripts/server_side_by_side.py``, :mod:`minfer.testing.side_by_side`) on
hand-made answers: shapes (keys and value types, not values), status codes, headers, streams, counts by group."""

from __future__ import annotations

from minfer.testing.side_by_side import (
    GROUPS,
    PROBES,
    Answer,
    compare,
    counts_by_group,
    report,
    shape_diff,
    stream_events,
)


def test_equal_shapes_with_different_values_do_not_differ():
    a = {"id": "x", "choices": [{"text": "hello", "index": 0}], "usage": {"n": 3}, "score": 1}
    b = {"id": "y", "choices": [{"text": "other", "index": 1}], "usage": {"n": 9}, "score": 0.5}
    assert shape_diff(a, b) == []


def test_missing_keys_and_type_changes_are_named_by_path():
    a = {"error": {"type": "authentication_error", "code": 401, "n_ctx": 256}, "only_a": True}
    b = {"error": {"type": "invalid_request_error", "code": "401", "param": None}}
    assert shape_diff(a, b) == ["$.only_a: only in A", "$.error.n_ctx: only in A", "$.error.param: only in B",
                                "$.error.code: number vs string"]


def test_lists_compare_their_first_items_and_empty_lists_match_any():
    assert shape_diff({"data": [{"a": 1}]}, {"data": [{"a": 1, "b": 2}, "x"]}) == ["$.data[0].b: only in B"]
    assert shape_diff({"data": []}, {"data": [{"a": 1}]}) == []
    assert shape_diff({"data": []}, {"data": {}}) == ["$.data: list vs object"]
    assert shape_diff(True, 1) == ["$: bool vs number"]


def test_compare_status_headers_and_body():
    a = Answer(200, {"access-control-allow-origin": "http://x", "content-type": "application/json; charset=utf-8"},
               {"ok": 1})
    b = Answer(401, {"content-type": "application/json"}, {"ok": 2, "error": {}})
    assert compare(a, b) == ["status: 200 vs 401", "header access-control-allow-origin: 'http://x' vs None",
                             "$.error: only in B"]
    same = Answer(200, {"content-type": "application/json"}, {"ok": 5})
    assert compare(Answer(200, {"content-type": "application/json"}, {"ok": 1}), same) == []
    # llama-server's empty Access-Control-Allow-Origin on a request without Origin is no header
    assert compare(Answer(200, {"access-control-allow-origin": ""}), Answer(200, {})) == []


def test_presence_headers_and_media_types():
    a = Answer(200, {"process-start-time-unix": "1", "content-type": "text/plain"})
    b = Answer(200, {"content-type": "application/json"})
    assert compare(a, b) == ["header process-start-time-unix: present vs absent",
                             "content-type: 'text/plain' vs 'application/json'"]


def test_streams_compare_their_first_and_last_events():
    text = 'data: {"a": 1}\n\ndata: {"a": 2, "timings": {}}\n\ndata: [DONE]\n\n'
    assert stream_events(text) == [{"a": 1}, {"a": 2, "timings": {}}]
    sse = {"content-type": "text/event-stream"}
    a = Answer(200, sse, events=stream_events(text))
    b = Answer(200, sse, events=[{"a": 3}, {"a": 4}])
    assert compare(a, b) == ["last event.timings: only in A"]
    assert compare(a, Answer(200, sse)) == ["stream: 2 vs 0 JSON events"]


def test_a_failed_request_is_a_difference():
    assert compare(Answer(0, {}, error="ConnectError"), Answer(200, {})) == ["request failed: A ConnectError, B ok"]


def test_counts_and_report_by_group():
    results = [{"group": "errors", "name": "x", "status": [400, 500], "differences": ["status: 400 vs 500"]},
               {"group": "errors", "name": "y", "status": [200, 200], "differences": []},
               {"group": "anthropic", "name": "z", "status": [200, 200], "differences": ["$.extra: only in B"]}]
    assert counts_by_group(results) == {"errors": (1, 1, 2), "anthropic": (1, 0, 1)}
    text = report(results, "A", "B")
    assert "  x (400 vs 500)\n    status: 400 vs 500" in text and "y (" not in text
    assert "errors                    1               1    2" in text
    assert "all                       2               1    3" in text


def test_every_probe_is_in_a_known_group_and_named_once():
    assert {p.group for p in PROBES} == set(GROUPS)
    assert len({p.name for p in PROBES}) == len(PROBES)
