"""The HTTP proxy's pieces, without processes: what the policy sees of a long prompt, the
rotation, the stream's event framing, the body check (``test_http_proxy_hostile.py`` runs
them all for real)."""

import asyncio

import pytest

from microvllm.router.http_proxy import HTTPProxy, json_object, whole_events
from microvllm.router.policies import make_policy
from microvllm.router.policy import ReplicaState, RoutedRequest


class CharTokenizer:
    """One token per character (its code point): enough to count what the proxy encodes."""

    def __init__(self):
        self.encoded: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded.append(text)
        return [ord(c) for c in text]


def test_the_policy_sees_only_the_head_of_a_long_prompt():
    tokenizer = CharTokenizer()
    proxy = HTTPProxy(["http://a", "http://b"], make_policy("prefix_aware"), tokenizer, block_size=4,
                      max_routed_chars=40)
    routed = proxy.route({"prompt": "x" * 1_000_000})
    assert tokenizer.encoded == ["x" * 40]                         # not the megabyte
    assert len(routed.block_hashes) == 9                           # 40 tokens, the cut block left out
    assert proxy.route({"prompt": "x" * 30}).block_hashes == routed.block_hashes[:7]   # same head, same hashes
    assert len(proxy.route({"prompt": list(range(1000))}).prompt_token_ids) == 40
    assert proxy.route({"prompt": {"not": "a prompt"}}).prompt_token_ids == ()    # the replica will say


def test_an_ejected_replica_gets_nothing_and_is_forgotten_by_the_policy():
    proxy = HTTPProxy(["http://a", "http://b"], make_policy("prefix_aware"), CharTokenizer(), block_size=4)
    first = proxy.route({"prompt": "a shared prefix, long enough"})
    home = proxy.choose(first)
    again = proxy.route({"prompt": "a shared prefix, long enough!"})
    assert proxy.choose(again) == home                            # the tree remembers where it went
    proxy.eject(home, "refused")
    assert proxy.choose(again) == 1 - home and proxy.choose(again, exclude=[1 - home]) is None
    proxy.admit(home)
    assert proxy.stats()["healthy"] == [True, True] and proxy.stats()["ejections"][home] == 1
    assert proxy.policy.tree.num_blocks[home] == 0                # its cache died with it


def test_prefix_aware_keeps_its_tree_when_shown_only_some_replicas():
    policy = make_policy("prefix_aware")
    policy.reset([100, 100, 100])
    request = RoutedRequest.from_token_ids("r", list(range(32)), 16)
    policy.on_routed(request, policy.choose(request, [ReplicaState(2, num_running=0)]))
    choice = policy.choose(request, [ReplicaState(1), ReplicaState(2, num_running=1)])
    assert choice.replica == 2 and choice.matched_blocks == 2


def test_whole_events_never_cuts_an_event():
    async def chunks():
        for piece in [b'data: {"a"', b': 1}\n', b'\ndata: {"b": 2}\n\ndata: {"c"', b": 3"]:
            yield piece

    async def collect():
        return [events async for events in whole_events(chunks())]

    # each piece ends where an event ends; a stream that stops midway keeps its tail for last
    assert asyncio.run(collect()) == [b'data: {"a": 1}\n\ndata: {"b": 2}\n\n', b'data: {"c": 3']


@pytest.mark.parametrize("raw, says", [(b"[1, 2]", "not an array"), (b'"x"', "not a string"),
                                       (b"3", "not a number"), (b"null", "not null"), (b"{", "malformed JSON")])
def test_a_body_must_be_a_json_object(raw, says):
    with pytest.raises(ValueError, match=says):
        json_object(raw)
    assert json_object(b'{"prompt": "hi"}') == {"prompt": "hi"}
