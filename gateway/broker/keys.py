"""Where a topic lives in Redis (docs/cluster.md §2): the names of its keys and channel, in one place.

`{T}` braces put a topic's keys in one hash slot, so a topic's script touches one shard of a Redis Cluster.
"""

from __future__ import annotations

from core.errors import BadTopic


def _topic(topic: str) -> str:
    """`topic`, refused when it could leave its hash tag: the grammar (core.topics.check_topic_name) already
    refuses `{` and `}` in every name a client, publisher or operator gives; this is the key space's own
    guard, so no name that slipped past it can reach another topic's or a private queue's keys."""
    if "{" in topic or "}" in topic:
        raise BadTopic(f"topic name {topic[:64]!r} may not hold `{{` or `}}`")
    return topic


#: The hash tag of the cluster-wide keys on Redis Cluster (control channel, revocations, node registry, topic
#: listing): one fixed slot, so the multi-key reads of the node registry (MGET) stay on one shard. It holds a
#: space, which no topic name may (core.topics.check_topic_name): no topic's keys share its names.
CLUSTER_TAG = "{cluster wide}"


class Keys:
    def __init__(self, prefix: str, sharded: bool = False) -> None:
        self.prefix = prefix
        #: on Redis Cluster the cluster-wide keys carry CLUSTER_TAG; on one Redis they keep their plain names
        self.sharded = sharded
        fixed = f"{prefix}:{CLUSTER_TAG}:" if sharded else f"{prefix}:"
        self.fixed = fixed
        #: sorted set: topic name -> time of its last publish (the admin API's cluster-wide listing). On one
        #: Redis the scripts write it (and check the bound against it); on Redis Cluster the nodes do
        #: (topic_directory.py), since a script may only touch its topic's slot.
        self.topics = f"{fixed}topics"
        #: sorted set: node id -> when it last wrote its stats (Unix seconds); the stats stream reads the live
        #: nodes' keys from it (O(nodes), no SCAN of the keyspace). Readers drop stale members.
        self.node_index = f"{fixed}nodes"
        #: string with a short TTL, set by a node whose stats stream has a viewer: while it exists every node
        #: puts its client summary into its `node` key (cluster_info.py)
        self.stats_watched = f"{fixed}stats:watched"
        #: pub/sub channel of the operators' control commands, which every node subscribes (control.py)
        self.control = f"{fixed}control"
        #: hash: revocation key (`jti:J`, `user:U`) -> the entry (JSON), reread by a node that (re)connects
        self.revocations = f"{fixed}revocations"

    def reply(self, request: str) -> str:
        """List with a short TTL: the other nodes' answers to one control command (JSON each)."""
        return f"{self.fixed}reply:{request}"

    def meta(self, topic: str) -> str:
        """Hash: `e` epoch, `n` next seq, `k` kind, `cap` capacity, `c` settings (JSON), `v` last value (snapshot)."""
        return f"{self.prefix}:{{{_topic(topic)}}}:m"

    def stream(self, topic: str) -> str:
        """Stream of a ring topic: id `SEQ-1`, field `d` the data (JSON), capped at `cap` entries."""
        return f"{self.prefix}:{{{_topic(topic)}}}:s"

    def channel(self, topic: str) -> str:
        """Pub/sub channel: `EPOCH SEQ DATA` per publish, `! deleted` when an operator deletes the topic."""
        return f"{self.prefix}:{{{_topic(topic)}}}:c"

    def topic_of(self, channel: str) -> str:
        """The topic a channel name belongs to (`channel`'s inverse)."""
        return channel[len(self.prefix) + 2 : -3]

    def queue(self, topic: str, owner: str) -> tuple[str, str, str]:
        """A private queue (docs/cluster.md §8): its hash (`e` epoch, `n` next seq, `b` bytes, `h` holder),
        its list (the queued data, oldest first) and its channel (`n NEXT` after an append, `t NODE` when
        a node takes it over). The owner comes last, so no owner's names collide with another's."""
        topic = _topic(topic)
        return (
            f"{self.prefix}:{{{topic}}}:qm:{owner}",
            f"{self.prefix}:{{{topic}}}:ql:{owner}",
            f"{self.prefix}:{{{topic}}}:qc:{owner}",
        )

    def presence_nodes(self, topic: str) -> str:
        """Set: the nodes holding presence members of the topic (gateway/broker/presence_store.py)."""
        return f"{self.prefix}:{{{_topic(topic)}}}:pn"

    def presence_members(self, topic: str, node_id: str) -> tuple[str, str]:
        """A node's presence members of the topic: hash client id -> member (JSON), and hash owner -> its
        member count there. Written by that node only."""
        topic = _topic(topic)
        return f"{self.prefix}:{{{topic}}}:pm:{node_id}", f"{self.prefix}:{{{topic}}}:pu:{node_id}"

    def presence_alive(self, node_id: str) -> str:
        """String with a short TTL, refreshed every second: the node's presence members count while it exists."""
        return f"{self.prefix}:palive:{node_id}"

    def node(self, node_id: str) -> str:
        """String with a TTL: a node's counters (JSON), refreshed every second."""
        return f"{self.fixed}node:{node_id}"


def stream_id(seq: int) -> str:
    """A seq as a stream id: `0-0` is not a valid id, so seq N is `N-1`."""
    return f"{seq}-1"


def seq_of(stream_id: bytes) -> int:
    return int(stream_id.split(b"-", 1)[0])
