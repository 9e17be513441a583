"""The Responses API's items (gateway/response_items.py; a stored response's input items,
gateway/stored_responses.py): the chat path's messages back as items, with ids of their own, paged as
OpenAI's lists are, bad paging a 400 naming the parameter."""
from __future__ import annotations

import pytest

from gateway.openai_errors import OpenAIError
from gateway.openai_protocol import CalledFunction, ChatMessage, MessageToolCall
from gateway.response_items import ItemList, page_of
from gateway.stored_responses import input_items

RID = "resp_" + "ab" * 16


def test_messages_become_items_an_assistants_calls_each_its_own():
    call = MessageToolCall(id="c1", function=CalledFunction("f", "{}"))
    items = input_items([ChatMessage(role="developer", content="d"), ChatMessage(role="assistant", content=None,
                                                                                tool_calls=[call, call]),
                         ChatMessage(role="tool", content="out", tool_call_id="c1"),
                         ChatMessage(role="assistant", content="")], RID)
    assert [i["type"] for i in items] == ["message", "function_call", "function_call", "function_call_output",
                                          "message"]
    assert items[0]["content"] == [{"type": "input_text", "text": "d"}] and items[0]["role"] == "developer"
    assert items[4]["content"][0]["type"] == "output_text"  # an empty answer is still the assistant's message
    assert len({i["id"] for i in items}) == 5 and all("ab" * 16 in i["id"] for i in items)


def _page(items, query):
    return page_of(items, query, lambda item: item["id"])


def test_pages_go_in_either_order_from_after():
    items = [{"id": f"i{n}"} for n in range(5)]
    page, more = _page(items, {"order": "asc", "limit": "2", "after": "i0"})
    assert ([i["id"] for i in page], more) == (["i1", "i2"], True)
    assert [i["id"] for i in _page(items, {})[0]] == ["i4", "i3", "i2", "i1", "i0"]
    assert not _page(items, {"after": "i1"})[1] and _page([], {}) == ([], False)


def test_a_list_names_its_first_and_last_items():
    page = ItemList.of([{"id": "a"}, {"id": "b"}], True)
    assert (page.first_id, page.last_id, page.has_more, page.object) == ("a", "b", True, "list")
    assert (ItemList.of([]).first_id, ItemList.of([]).last_id) == (None, None)


@pytest.mark.parametrize("query, param", [({"order": "up"}, "order"), ({"limit": "0"}, "limit"),
                                          ({"limit": "101"}, "limit"), ({"limit": "x"}, "limit"),
                                          ({"after": "nope"}, "after")])
def test_bad_paging_is_a_400_naming_the_parameter(query, param):
    with pytest.raises(OpenAIError) as info:
        _page([{"id": "i0"}], query)
    assert (info.value.status, info.value.param) == (400, param)
