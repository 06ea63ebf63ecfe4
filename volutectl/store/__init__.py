"""The durable queue: SQLite, its schema and migrations, and the in-memory index.

- `queue`: `Store`, deliveries and turns on disk, each change one transaction.
- `indexed`: `IndexedStore`, the store that keeps `index` (the pending queue in memory)
  in step with each commit; the gate uses this one.
- `schema` (migrations), `rows` (the records it takes and gives), `minds` (pauses),
  `quotas` (per-uid sums), `retention` (removing what is done, in batches).

Never imports the gate: the gate calls the store, not the reverse.
"""
