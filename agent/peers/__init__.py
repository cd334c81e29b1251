"""Agent to agent: this node's store of shards, where its snapshot is replicated (:mod:`.placement`), the server
other agents send replicas to and read them from, and its client."""

__all__: list[str] = []
