"""Agent to agent: where a node's snapshot is replicated (:mod:`.placement`), and the link that carries it."""

__all__: list[str] = []
