"""What happens to a batch once it arrives: ingest, the rule engine, ranks, evidence snapshots, captures,
retention, imports, and the services object that wires the store and the engine together."""
