"""The peer link: this node's store of shards, the server other agents send replicas to, and its client."""

__all__ = []
