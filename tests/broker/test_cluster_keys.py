"""The key layout on Redis Cluster (gateway/broker/keys.py, scripts.py; docs/cluster.md §10): a topic's keys
and channels in its one slot, the cluster-wide keys on one fixed slot no topic shares, and the scripts'
channel messages by sharded pub/sub."""

from __future__ import annotations

import pytest

from gateway.broker import scripts
from gateway.broker.keys import Keys
from loadtest.clusterproc import key_slot

pytestmark = pytest.mark.unit


def test_a_topics_keys_and_channels_share_one_slot():
    keys = Keys("fanout", sharded=True)
    topic = "news.sport"
    names = [
        keys.meta(topic),
        keys.stream(topic),
        keys.channel(topic),
        *keys.queue(topic, "u1"),
        keys.presence_nodes(topic),
        *keys.presence_members(topic, "n1"),
    ]
    assert {key_slot(n) for n in names} == {key_slot("news.sport")}


def test_the_cluster_wide_keys_sit_on_one_fixed_slot_on_cluster_and_keep_their_names_on_one_redis():
    sharded, single = Keys("fanout", sharded=True), Keys("fanout")
    wide = [
        sharded.topics,
        sharded.node_index,
        sharded.stats_watched,
        sharded.control,
        sharded.revocations,
        sharded.node("n1"),
        sharded.reply("r1"),
    ]
    assert len({key_slot(n) for n in wide}) == 1
    assert all("{cluster wide}" in n for n in wide)
    assert (single.topics, single.control, single.node("n1")) == ("fanout:topics", "fanout:control", "fanout:node:n1")


def test_sharded_scripts_publish_with_spublish_only():
    for name in scripts.NAMES:
        text = scripts.source(name, sharded=True)
        assert "'PUBLISH'" not in text
        assert text == scripts.source(name, sharded=False).replace("'PUBLISH'", "'SPUBLISH'")
    assert "SPUBLISH" in scripts.source("PUBLISH", sharded=True)
