"""KV connectors: the base class with its two sides, the factory, one file per connector."""
